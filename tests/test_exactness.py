"""Greedy output equals mlx-lm's own greedy decoding, token for token."""

import random
from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

import dflash2_mlx
from dflash2_mlx.model.drafter import Proposal
from dflash2_mlx.policy.adaptive import FixedWidth
from dflash2_mlx.decode.stats import GenerationStats
from dflash2_mlx.decode.engine import stream_tokens
from dflash2_mlx.policy.planner import Planner
from dflash2_mlx.model.sampling import Sampling
from fixtures import drafter_args, write_drafter

pytestmark = pytest.mark.rows

PROMPTS = ["def add(a, b):", "Hello! How can I help you today?", "for i in range(10):"]
MAX_TOKENS = 40


def mlx_lm_greedy(model, ids, max_tokens, stop_ids=()):
    """mlx-lm's greedy continuation, up to and including the first stop token."""
    out = []
    for token, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens):
        out.append(token)
        if token in stop_ids:
            break
    return out


@pytest.fixture(scope="module")
def pipelines(llama_dir, qwen3_dir, dflash_dir, dflash2_dir):
    return {(fam, kind): dflash2_mlx.load(str(t), str(d))
            for fam, t in (("llama", llama_dir), ("qwen3", qwen3_dir))
            for kind, d in (("dflash", dflash_dir), ("dflash2", dflash2_dir))}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_greedy_equals_mlx_lm(pipelines, family, kind):
    pipe = pipelines[(family, kind)]
    for prompt in PROMPTS:
        ids = pipe.encode(prompt)
        ref = mlx_lm_greedy(pipe.target, ids, MAX_TOKENS)
        assert len(set(ref)) > 3, "fixture target too degenerate to test anything"
        for b in (1, 2, 3, 5, 8, 16):
            gen = pipe.generate(prompt, max_tokens=MAX_TOKENS, block_size=b)
            assert gen.tokens == ref, f"{family}/{kind} b={b} prompt={prompt!r}"
            assert gen.finish_reason == "length"
            assert gen.stats.block_size == b
            assert gen.stats.generated_tokens == MAX_TOKENS
            if b > 1:
                assert gen.stats.cycles > 0


def test_stops_at_eos_and_text_excludes_it(pipelines):
    pipe = pipelines[("llama", "dflash2")]
    ids = pipe.encode(PROMPTS[0])
    ref = mlx_lm_greedy(pipe.target, ids, MAX_TOKENS)
    stop = ref[12]                       # a token the target emits: treat it as an end token
    expected = ref[: ref.index(stop) + 1]
    for b in (2, 5, 16):
        gen = pipe.generate(PROMPTS[0], max_tokens=MAX_TOKENS, block_size=b, stop_tokens=[stop])
        assert gen.tokens == expected
        assert gen.finish_reason == "stop"
        assert gen.text == pipe.tokenizer.decode(expected[:-1])


def test_max_tokens_exact_count(pipelines):
    pipe = pipelines[("qwen3", "dflash2")]
    ids = pipe.encode(PROMPTS[1])
    for max_tokens in (1, 2, 7, 17):
        ref = mlx_lm_greedy(pipe.target, ids, max_tokens)
        gen = pipe.generate(ids, max_tokens=max_tokens, block_size=8)
        assert gen.tokens == ref and len(gen.tokens) == max_tokens


def test_stream_chunks_add_up(pipelines):
    pipe = pipelines[("llama", "dflash")]
    chunks = list(pipe.stream(PROMPTS[2], max_tokens=30, block_size=4))
    gen = pipe.generate(PROMPTS[2], max_tokens=30, block_size=4)
    assert [t for c in chunks for t in c.tokens] == gen.tokens
    assert "".join(c.text for c in chunks) == gen.text
    assert chunks[-1].finish_reason == "length"
    assert all(c.finish_reason is None for c in chunks[:-1])


@pytest.mark.parametrize("layer_types", [("sliding_attention", "full_attention"),
                                         ("sliding_attention", "sliding_attention")])
def test_sliding_window_drafter_long_prompt(fixture_dir, llama_dir, layer_types):
    args = drafter_args(layer_types=layer_types, sliding_window=6, block_size=8)
    folder = write_drafter(fixture_dir / f"sliding-{len(set(layer_types))}", args, seed=5)
    pipe = dflash2_mlx.load(str(llama_dir), str(folder))
    prompt = " ".join(PROMPTS * 3)       # far longer than the window
    ids = pipe.encode(prompt)
    assert len(ids) > 4 * args.sliding_window
    ref = mlx_lm_greedy(pipe.target, ids, MAX_TOKENS)
    for b in (3, 8):
        assert pipe.generate(prompt, max_tokens=MAX_TOKENS, block_size=b).tokens == ref
    # small prefill chunks exercise the chunked prefill and the bounded feature buffer
    pipe.prefill_step_size = 7
    assert pipe.generate(prompt, max_tokens=MAX_TOKENS, block_size=8).tokens == ref


class OracleDrafter:
    """A drafter double at the engine boundary: proposes the target's true greedy continuation,
    corrupted at a random position in some cycles, so partial and full acceptance both occur."""

    def __init__(self, prompt_len, continuation, vocab, corrupt_p=0.5, seed=0):
        self.prompt_len, self.truth, self.vocab = prompt_len, continuation, vocab
        self.corrupt_p, self.rng = corrupt_p, random.Random(seed)
        self.seen = 0                    # target rows whose features reached the drafter
        self.context_window = None
        self.args = SimpleNamespace(block_size=16, max_width=16)

    def make_cache(self):
        return []

    def skip_context(self, cache, n):
        self.seen += n

    def propose(self, target, anchor, feats, cache, width, sampling, key):
        self.seen += feats.shape[1]
        k = self.seen - self.prompt_len + 1          # tokens generated so far (anchor = last)
        assert anchor.item() == self.truth[k - 1]
        tokens = list(self.truth[k : k + width - 1])
        tokens += [0] * (width - 1 - len(tokens))
        if self.rng.random() < self.corrupt_p:
            j = self.rng.randrange(width - 1)
            tokens[j] = (tokens[j] + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
        return Proposal(mx.array([tokens], dtype=mx.uint32))

    def propose_batch(self, target, drafts):
        return [self.propose(target, *d) for d in drafts]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_partial_and_full_acceptance_stay_exact(pipelines, family):
    pipe = pipelines[(family, "dflash2")]
    for seed, prompt in enumerate(PROMPTS):
        ids = pipe.encode(prompt)
        ref = mlx_lm_greedy(pipe.target, ids, 60)
        for b in (2, 5, 8, 16):
            oracle = OracleDrafter(len(ids), ref, pipe.adapter.vocab_size, seed=seed * 31 + b)
            stats = GenerationStats()
            out = [t for step in stream_tokens(pipe.adapter, oracle, ids, max_tokens=60,
                                               sampling=Sampling(), planner=Planner(),
                                                                    policy=FixedWidth(b),
                                               stop_ids=set(), stats=stats) for t in step]
            assert out == ref, f"{family} b={b}"
            assert max(stats.accepted) == b - 1, "no fully accepted block"
            assert any(0 < a < b - 1 for a in stats.accepted) or b == 2, "no partial acceptance"
            assert min(stats.accepted) < b - 1


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_draft_vocabulary_proposes_only_its_ids_and_stays_exact(pipelines, kind):
    """A drafter with a draft vocabulary (`draft_vocab.json`) scores only those rows of the
    target's head; output stays exactly the target's, greedy and sampled."""
    from dflash2_mlx.model.drafter import DraftVocab
    pipe = pipelines[("llama", kind)]
    ids = pipe.encode(PROMPTS[0])
    ref = mlx_lm_greedy(pipe.target, ids, MAX_TOKENS)
    vocab = sorted(set(ref) | set(range(0, 384, 2)))
    pipe.drafter.draft_vocab = DraftVocab(vocab)
    try:
        oracle_free = pipe.generate(ids, max_tokens=MAX_TOKENS, block_size=8)
        assert oracle_free.tokens == ref
        drafted = pipe.drafter.propose(pipe.adapter, mx.array([[ids[-1]]], dtype=mx.uint32),
                                       None, pipe.drafter.make_cache(), 8, Sampling(1.0),
                                       mx.random.key(0))
        assert set(drafted.tokens.reshape(-1).tolist()) <= set(vocab)
        sampled = pipe.generate(ids, max_tokens=20, block_size=4, temperature=1.0, seed=1)
        assert len(sampled.tokens) == 20
    finally:
        pipe.drafter.draft_vocab = None


def test_plain_steps_run_ahead_and_leave_the_state_whole(pipelines):
    """Plain steps launch the next one before reading their token (mlx-lm's double buffering).
    The output stays mlx-lm's, and the DecodeState counts the row of a launched step when the
    generation ends on a stop token or is abandoned, so a prefix cache can reuse it."""
    from dflash2_mlx.decode.state import DecodeState

    pipe = pipelines[("llama", "dflash2")]
    ids = pipe.encode(PROMPTS[0])
    ref = mlx_lm_greedy(pipe.target, ids, MAX_TOKENS)
    # a stop token that a plain step produces (not the first token, which prefill gives)
    stop = next(t for i, t in enumerate(ref) if i >= 3 and t not in ref[:i])

    def whole(state):
        rows = state.dcache[0].offset + sum(p.shape[1] for p in state.pending)
        return state.cache[0].offset == len(state.tokens) == rows

    for stop_tokens, want, fed in (([], ref, ref[:-1]),
                                   ([stop], ref[: ref.index(stop) + 1],
                                    ref[: ref.index(stop) + 1])):
        state = DecodeState.new(pipe.adapter, pipe.drafter)
        gen = pipe.generate(ids, max_tokens=MAX_TOKENS, block_size=1, stop_tokens=stop_tokens,
                            state=state)
        assert gen.tokens == want
        assert state.tokens == ids + fed and whole(state)
    state = DecodeState.new(pipe.adapter, pipe.drafter)
    chunks = pipe.stream(ids, max_tokens=MAX_TOKENS, block_size=1, state=state)
    got = [next(chunks).tokens[0] for _ in range(5)]
    chunks.close()                                   # a client that went away
    assert got == ref[:5] and whole(state) and state.tokens[: len(ids) + 4] == ids + ref[:4]
    again = pipe.generate(ids + ref[:5], max_tokens=8, block_size=1, state=state)
    assert again.tokens == mlx_lm_greedy(pipe.target, ids + ref[:5], 8)
