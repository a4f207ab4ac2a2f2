"""Lookup drafting: the index against a brute-force search, and exact greedy decoding with the
lookup on (alone, and beside the drafter), including stops and max_tokens inside a lookup run."""

import random

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

import dflash2_mlx
from dflash2_mlx.decode.lookup import LookupConfig, LookupIndex


def brute_force(seq, min_n, max_n, k):
    """The longest suffix of min_n..max_n tokens that occurred earlier with a token after it;
    its latest such occurrence; the k tokens after it (copying on past the present)."""
    L = len(seq)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        ends = [e for e in range(n, L) if seq[e - n : e] == seq[L - n :]]
        if ends:
            virtual = list(seq)
            start = max(ends)
            for j in range(k):
                virtual.append(virtual[start + j])
            return virtual[L:]
    return None


@pytest.mark.parametrize("alphabet,min_n,max_n", [(3, 1, 4), (5, 2, 8), (20, 2, 3), (2, 3, 6)])
def test_index_equals_brute_force_on_random_streams(alphabet, min_n, max_n):
    rng = random.Random(alphabet * 100 + min_n)
    for trial in range(20):
        index = LookupIndex(LookupConfig(min_n, max_n, sticky=False))
        seq = []
        for _ in range(60):
            chunk = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 4))]
            index.extend(chunk)
            seq += chunk
            k = rng.randrange(1, 12)
            got, want = index.propose(k), brute_force(seq, min_n, max_n, k)
            assert (got and got[1]) == want, (trial, seq, k)
            if got:
                n = got[0]        # the longest: its suffix recurs, a longer one does not
                assert brute_force(seq, n, n, 1) and not brute_force(seq, n + 1, max_n, 1)


@pytest.mark.parametrize("alphabet,min_n,max_n", [(3, 1, 4), (5, 2, 8), (2, 3, 6)])
def test_a_sticky_match_agrees_at_least_as_far_back_as_the_longest(alphabet, min_n, max_n):
    """Sticky (the default): a match exists exactly when the longest suffix recurs; its source
    is preceded by at least as many tokens agreeing with the context's end as the longest
    recurring suffix has (the source copied from, or that suffix's latest occurrence)."""
    rng = random.Random(alphabet * 7 + min_n)
    for trial in range(20):
        index, seq = LookupIndex(LookupConfig(min_n, max_n)), []
        for _ in range(60):
            chunk = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 4))]
            index.extend(chunk)
            seq += chunk
            got, longest = index.match(), brute_force(seq, min_n, max_n, 1)
            assert (got is None) == (longest is None), (trial, seq)
            if got:
                n, i = got
                L = next(m for m in range(max_n, min_n - 1, -1) if brute_force(seq, m, m, 1))
                assert n >= L and i < len(seq) and seq[i - L : i] == seq[-L:], (trial, seq)


def test_sticky_keeps_copying_the_line_it_copies():
    """Copying a line whose last n-gram recurs later in another line: the latest occurrence
    proposes the other line's continuation, sticky the copied line's (its source agrees over
    more tokens than max_n). Once the output leaves the source, the latest occurrence rules."""
    one, two = [1, 2, 3, 4, 5, 6, 9, 9], [0, 4, 5, 6, 8, 8]
    sticky = LookupIndex(LookupConfig(2, 3), one + two)
    latest = LookupIndex(LookupConfig(2, 3, sticky=False), one + two)
    for index in (sticky, latest):
        assert index.propose(2) is None
        index.extend([1, 2, 3])
        assert index.propose(2) == (3, [4, 5])           # both: line one, the only "1 2 3"
        index.extend([4, 5, 6])
    assert latest.propose(2) == (3, [8, 8])              # line two's "4 5 6"
    assert sticky.propose(2) == (3, [9, 9]) and sticky.depth == 6
    sticky.extend([8])                                   # the output left line one
    assert sticky.source is None and sticky.propose(1) == (3, [8])   # "5 6 8": line two


def test_index_built_at_once_equals_incremental():
    rng = random.Random(1)
    seq = [rng.randrange(6) for _ in range(300)]
    a, b = LookupIndex(tokens=seq), LookupIndex()
    for t in seq:
        b.extend([t])
    assert a.last == b.last and a.propose(9) == b.propose(9)


def test_repetition_continues_and_no_match_is_none():
    index = LookupIndex(LookupConfig(2, 4), [1, 2, 3, 1, 2, 3, 1, 2])
    assert index.match() == (4, 5)                   # suffix 2 3 1 2 seen at 1..4, then 3
    assert index.propose(7) == (4, [3, 1, 2, 3, 1, 2, 3])  # copies on from its proposal
    assert LookupIndex(tokens=[1, 2, 3, 4, 5]).propose(3) is None
    assert LookupIndex(tokens=[1, 2, 1]).propose(3) is None      # min_n 2: one token is no cue


def test_shortest_match_grows_with_the_context():
    """From `grow_from` tokens a match needs one more token per doubling of the context: a
    recurring 2-gram in 2k tokens of code is mostly chance (docs/lookup.md)."""
    config = LookupConfig()
    assert [config.shortest(n) for n in (10, 1023, 1024, 2047, 2048, 4096, 8192, 10 ** 6)] \
        == [2, 2, 3, 3, 4, 5, 6, 8]
    assert LookupConfig(grow_from=None).shortest(10 ** 6) == 2
    filler = [100 + (i * 7919) % 5000 for i in range(3000)]     # no 2-gram recurs in it
    index = LookupIndex(config, [1, 2, 9] + filler + [1, 2])
    assert index.propose(3) is None                     # 3003 tokens: 4 needed, 2 recur
    index = LookupIndex(config, [1, 2, 3, 4, 9] + filler + [1, 2, 3, 4])
    assert index.propose(3) == (4, [9] + filler[:2])
    assert LookupIndex(LookupConfig(grow_from=None), [1, 2, 9] + filler + [1, 2]).propose(1) \
        == (2, [9])


@pytest.mark.parametrize("bad", [dict(min_n=0), dict(min_n=5, max_n=4), dict(max_width=1),
                                 dict(grow_from=0)])
def test_config_is_checked(bad):
    with pytest.raises(ValueError, match="lookup"):
        LookupConfig(**bad)


# ----------------------------------------------------------------------------- exactness

PROMPTS = ["def add(a, b):", "Hello! How can I help you today?",
           "def add(a, b):\n    return a + b\ndef add(a, b):"]


def mlx_lm_greedy(model, ids, n):
    return [t for t, _ in generate_step(mx.array(ids), model, max_tokens=n)]


@pytest.fixture(scope="module")
def pipes(llama_dir, dflash2_dir):
    return {"hybrid": dflash2_mlx.load(str(llama_dir), str(dflash2_dir)),
            "alone": dflash2_mlx.load(str(llama_dir))}


@pytest.mark.parametrize("kind", ["hybrid", "alone"])
def test_greedy_equals_mlx_lm_with_lookup(pipes, kind):
    pipe = pipes[kind]
    lookup_cycles = 0
    for prompt in PROMPTS:
        ids = pipe.encode(prompt)
        ref = mlx_lm_greedy(pipe.target, ids, 60)
        for b in (2, 5, 16, "auto"):
            gen = pipe.generate(ids, max_tokens=60, block_size=b, lookup=True)
            assert gen.tokens == ref, (kind, prompt, b)
            lookup_cycles += gen.stats.to_dict()["cycles_lookup"]
            if kind == "alone":
                assert not gen.stats.drafting("drafter")
    assert lookup_cycles > 10, "the lookup never drafted: the test checks nothing"


def test_lookup_only_pipeline_widths(pipes):
    pipe = pipes["alone"]
    assert pipe.block_size(None) == "auto" and pipe.block_size(16) == 16
    with pytest.raises(ValueError, match="1..16"):
        pipe.block_size(17)
    assert pipe.block_size(None, lookup=False) == 1
    with pytest.raises(ValueError, match="needs a drafter or lookup"):
        pipe.generate("hi", block_size=4, lookup=False)


def test_stop_token_inside_a_lookup_run(pipes):
    """A stop token that the lookup itself proposes in the middle of an accepted run (its
    first appearance in the output), for both pipelines. The prompt holds the target's own
    continuation of its start (ids + output + ids), so there is text to copy from it."""
    tried = 0
    for pipe in pipes.values():
        for prompt in PROMPTS:
            start = pipe.encode(prompt)
            ids = start + mlx_lm_greedy(pipe.target, start, 40) + start
            ref = mlx_lm_greedy(pipe.target, ids, 60)
            full = pipe.generate(ids, max_tokens=60, block_size=16)
            before = 1                                  # tokens committed before each step
            for c in full.stats.steps:
                firsts = [before + j for j in range(1, c.accepted)
                          if ref[before + j] not in ref[: before + j]]
                if c.source == "lookup" and firsts:
                    stop = ref[firsts[0]]
                    gen = pipe.generate(ids, max_tokens=60, block_size=16, stop_tokens=[stop])
                    assert gen.tokens == ref[: firsts[0] + 1] and gen.finish_reason == "stop"
                    tried += 1
                    break
                before += c.accepted + 1
    assert tried >= 2, "no lookup run with a new token inside it: the test checks nothing"


def test_max_tokens_inside_a_lookup_run(pipes):
    pipe = pipes["alone"]
    ids = pipe.encode(PROMPTS[0])
    ref = mlx_lm_greedy(pipe.target, ids, 60)
    for n in range(20, 31):
        gen = pipe.generate(ids, max_tokens=n, block_size=16)
        assert gen.tokens == ref[:n] and gen.stats.generated_tokens == n
        assert gen.finish_reason == "length"
        assert sum(c.accepted + 1 for c in gen.stats.steps) + 1 == n


def test_no_lookup_means_drafter_only(pipes):
    pipe = pipes["hybrid"]
    gen = pipe.generate(PROMPTS[2], max_tokens=40, block_size=8, lookup=False)
    d = gen.stats.to_dict()
    assert d["cycles_lookup"] == 0 and d["tau_lookup"] is None and d["cycles_drafter"] > 0
    assert d["position_acceptance_lookup"] == []
    on = pipe.generate(PROMPTS[2], max_tokens=40, block_size=8, lookup=True).stats.to_dict()
    assert on["cycles_lookup"] > 0 and on["tau_lookup"] is not None
    with pytest.raises(ValueError, match="lookup: .yes. is not True or False"):
        pipe.generate("hi", lookup="yes")


def test_chunks_carry_their_own_stats(pipes):
    chunks = list(pipes["hybrid"].stream(PROMPTS[0], max_tokens=30, block_size=4))
    counts = [c.stats.generated_tokens for c in chunks]
    assert counts == sorted(counts) and counts[0] == 1 and counts[-1] == 30
    assert len({id(c.stats) for c in chunks}) == len(chunks)
    assert [len(c.stats.steps) for c in chunks] == list(range(len(chunks)))
