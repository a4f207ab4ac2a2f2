"""The prefix cache of `dflash2-mlx serve`: longest prefix, copies out, LRU bounds, and exact
output with a hit (real DecodeStates on the tiny fixtures)."""

import pytest

import dflash2_mlx
from dflash2_mlx.decode.state import DecodeState
from dflash2_mlx.cache.prompt import PromptCache


@pytest.fixture(scope="module")
def pipe(llama_dir, dflash2_dir):
    return dflash2_mlx.load(str(llama_dir), str(dflash2_dir), lookup=True)


def run(pipe, ids, state=None, **kw):
    state = state if state is not None else DecodeState.new(pipe.adapter, pipe.drafter)
    gen = pipe.generate(ids, max_tokens=12, block_size=6, state=state, **kw)
    return gen, state


def test_hit_is_a_trimmed_copy_and_output_is_unchanged(pipe):
    a = pipe.encode("def add(a, b):")
    b = pipe.encode("The quick brown fox")
    cache = PromptCache(max_entries=4)
    gen_a, state_a = run(pipe, a)
    cache.insert(state_a)
    cache.insert(run(pipe, b)[1])
    assert state_a.tokens == a + gen_a.tokens[:-1]

    follow = a + gen_a.tokens + pipe.encode("for i in range(10):")
    got, common = cache.fetch(follow)
    assert common == len(state_a.tokens) and got.tokens == state_a.tokens
    assert got is not state_a and got.cache[0] is not state_a.cache[0]
    # a branch off the middle of the first prompt: trimmed, the entry untouched
    branch = a[:5] + pipe.encode("print(1)")
    short, n = cache.fetch(branch)
    assert n == 5 and short.tokens == a[:5]
    assert len(state_a.tokens) == len(a) + len(gen_a.tokens) - 1
    for prompt, state in ((follow, got), (branch, short)):
        for options in ({}, {"temperature": 1.0, "seed": 4}):
            want = pipe.generate(prompt, max_tokens=12, block_size=6, **options)
            hit, _ = run(pipe, prompt, state.copy(), **options)
            assert hit.tokens == want.tokens and hit.stats.cached_tokens == len(state.tokens)
    assert cache.stats.hits == 2 and cache.stats.lookups == 2
    assert cache.fetch([a[0] + 1, 7, 7]) == (None, 0)


def test_bounded_by_entries_and_bytes_least_recently_used_out(pipe):
    states = [run(pipe, pipe.encode(p, chat_template=False))[1]
              for p in ("a = 1", "The fox", "import math")]       # no common prefix
    cache = PromptCache(max_entries=2)
    cache.insert(states[0].copy())
    cache.insert(states[1].copy())
    assert cache.fetch(states[0].tokens + [5])[1] > 0       # now the most recently used
    cache.insert(states[2].copy())                           # evicts states[1]
    assert len(cache) == 2 and cache.fetch(states[1].tokens + [5])[1] == 0
    assert cache.fetch(states[0].tokens + [5])[1] == len(states[0].tokens)

    one = states[0].nbytes
    small = PromptCache(max_entries=8, max_bytes=one + one // 2)
    for s in states:
        small.insert(s.copy())
    assert len(small) == 1 and small.nbytes <= one + one // 2
    assert PromptCache(max_entries=0).fetch(states[0].tokens) == (None, 0)


def test_an_extended_conversation_replaces_its_prefix_entry(pipe):
    a = pipe.encode("def add(a, b):")
    gen, state = run(pipe, a)
    cache = PromptCache()
    cache.insert(state)
    nxt = a + gen.tokens + pipe.encode("more")
    hit, _ = cache.fetch(nxt)
    run(pipe, nxt, hit)
    cache.insert(hit)
    assert len(cache) == 1 and hit.tokens[:len(nxt)] == nxt
    assert cache.fetch(hit.tokens + [7])[1] == len(hit.tokens)


class Untrimmable:
    """A state whose caches cannot go back (a recurrent layer): only exact prefixes serve."""

    def __init__(self, tokens):
        self.tokens, self.cache, self.nbytes = list(tokens), [self], 100

    def is_trimmable(self):
        return False

    def copy(self):
        return Untrimmable(self.tokens)

    def trim(self, n):
        return n == len(self.tokens)


def test_untrimmable_states_serve_exact_prefixes_only():
    cache = PromptCache()
    cache.insert(Untrimmable([1, 2, 3]))
    cache.insert(Untrimmable([1, 2, 3, 4, 5, 6]))
    state, n = cache.fetch([1, 2, 3, 4, 9, 9])      # the longer one would need a trim
    assert n == 3 and state.tokens == [1, 2, 3]
    assert cache.stats.recomputed == 1
    assert cache.fetch([1, 2, 7, 7]) == (None, 0)
    assert cache.stats.recomputed == 3


def test_hybrid_target_reuses_exact_prefixes_and_recomputes_branches(caplog):
    """qwen3_5 (GatedDeltaNet layers): the recurrent state cannot be trimmed, so a branch off
    an entry is recomputed (and logged); a prompt that extends an entry reuses it exactly."""
    import logging

    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    from dflash2_mlx.policy.adaptive import FixedWidth
    from dflash2_mlx.decode.engine import stream_tokens
    from dflash2_mlx.policy.planner import Planner
    from dflash2_mlx.decode.lookup import LookupConfig
    from dflash2_mlx.model.sampling import Sampling
    from dflash2_mlx.model.target import TargetAdapter
    from test_families import CONFIGS

    cfg = CONFIGS["qwen3_5"]
    model_class, args_class = _get_classes(cfg)
    mx.random.seed(7)
    model = model_class(args_class.from_dict(cfg))
    adapter = TargetAdapter(model)
    adapter.embed_tokens.weight = adapter.embed_tokens.weight * 4
    mx.eval(model.parameters())

    def gen(prompt, state=None):
        out = stream_tokens(adapter, None, prompt, max_tokens=10, sampling=Sampling(),
                            planner=Planner(),
                            policy=FixedWidth(4), lookup=LookupConfig(), stop_ids=set(),
                            state=state)
        return [t for new in out for t in new]

    prompt = [5, 17, 99, 3, 250, 7, 42, 11, 5, 17, 99]
    state = DecodeState.new(adapter, None)
    answer = gen(prompt, state)
    cache = PromptCache()
    cache.insert(state)
    longer = prompt + answer + [9, 8]
    hit, n = cache.fetch(longer)
    assert n == len(prompt) + len(answer) - 1
    assert gen(longer, hit) == gen(longer)
    with caplog.at_level(logging.DEBUG, logger="dflash2_mlx.cache.prompt"):
        assert cache.fetch(prompt[:6] + [1, 2, 3]) == (None, 0)
    assert cache.stats.recomputed == 1 and "cannot be trimmed" in caplog.text
