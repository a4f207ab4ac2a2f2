"""The batch engine on hybrid GatedDeltaNet targets (qwen3_5, qwen3_next: recurrent layers beside
attention): the per-row rollback of the recurrent state against single-sequence caches, and
every sequence of a batch generating exactly what it generates alone, whatever runs beside it."""

import copy
import random

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import _get_classes

from dflash2_mlx.model.row_caches import RaggedKVCache, RecurrentRows, batch_cache, batch_refusal
from dflash2_mlx.decode.engine import CANCELLED, Engine, Request
from dflash2_mlx.policy.planner import Planner
from dflash2_mlx.decode.stats import DRAFTER, LOOKUP
from dflash2_mlx.model.target import TargetAdapter
from dflash2_mlx.policy.adaptive import AdaptiveWidth, FixedWidth
from dflash2_mlx.policy.batch import BatchAwareWidth
from dflash2_mlx.policy.costs import Correction, CostModel
from dflash2_mlx.testing import drafter_args, random_drafter
from fixtures import (Oracles, assert_burst_returns_to_idle, assert_seeded_batch_equals_alone,
                      run)
from test_exactness import mlx_lm_greedy
from test_families import CONFIGS

pytestmark = pytest.mark.rows

FEATURES = (1, 3)
HYBRID = ["qwen3_5", "qwen3_next"]


def hybrid(name: str) -> TargetAdapter:
    """The tiny random hybrid target of test_families (every other layer GatedDeltaNet)."""
    cfg = CONFIGS[name]
    model_class, args_class = _get_classes(cfg)
    mx.random.seed(7)
    model = model_class(args_class.from_dict(cfg))
    embed = TargetAdapter(model).embed_tokens
    embed.weight = embed.weight * 4
    mx.eval(model.parameters())
    adapter = TargetAdapter(model, FEATURES)
    assert adapter.recurrent, f"{name}: no recurrent layers"
    return adapter


@pytest.fixture(scope="module", params=HYBRID)
def target(request):
    return hybrid(request.param)


def auto_policy(shared: Correction) -> BatchAwareWidth:
    """`block_size="auto"` as the pipeline builds it, on fixed synthetic costs (a verify costs
    a fixed part plus a part per row)."""
    cost = CostModel((0.0,) + (0.01,) * 15, tuple(0.05 + 0.012 * w for w in range(1, 17)))
    return BatchAwareWidth(AdaptiveWidth(cost, {DRAFTER: 16, LOOKUP: 16}), shared)


def test_hybrid_caches_are_batchable(target):
    single = target.make_cache()
    assert batch_refusal(single) is None
    target.forward(mx.array([[3, 4, 5]]), single)
    kinds = {type(c) for c in batch_cache(single)}
    assert kinds == {RaggedKVCache, RecurrentRows}


def test_rollback_rows_equal_single_rollbacks(target):
    """Rows of different lengths verifying blocks of different widths, each keeping its own
    count (through a row leaving and a longer one joining): every row's logits are its single
    cache's, and every recurrent layer's row holds the state its single cache holds after the
    single-sequence rollback."""
    rng = random.Random(2)
    prompts = [[rng.randrange(300) for _ in range(n)] for n in (3, 11, 7, 15)]
    alone = [target.make_cache() for _ in prompts]
    for p, cache in zip(prompts, alone):
        target.forward(mx.array([p]), cache)
    live = [0, 1, 2]
    batch = batch_cache(alone[0])
    for b, *rows in zip(batch, *(batch_cache(alone[i]) for i in live[1:])):
        b.extend(*rows)                               # two rows joining at once
    rolled = 0
    for step in range(24):
        if step == 8:                                 # row 1 leaves, a longer one joins
            for c in batch:
                c.filter([0, 2])
            for b, r in zip(batch, batch_cache(alone[3])):
                b.extend(r)
            live = [0, 2, 3]
        widths = [rng.randint(1, 6) for _ in live]
        T = max(widths)
        blocks = [[rng.randrange(300) for _ in range(w)] for w in widths]
        snap = target.snapshot(batch)
        logits, _ = target.forward(mx.array([b + [0] * (T - len(b)) for b in blocks]), batch)
        keep = [rng.randint(1, w) for w in widths]
        for j, (i, block, k) in enumerate(zip(live, blocks, keep)):
            single = target.snapshot(alone[i])
            ref, _ = target.forward(mx.array([block]), alone[i])
            np.testing.assert_allclose(np.array(logits[j, : len(block)]), np.array(ref[0]),
                                       atol=1e-4, rtol=1e-4, err_msg=f"step {step} row {j}")
            single.rollback(k, len(block))
        for c in batch:
            if isinstance(c, RaggedKVCache):
                c.commit(keep)
        snap.rollback_rows(keep, T)
        rolled += sum(k < T for k in keep)
    assert rolled > 20
    for j, i in enumerate(live):
        for b, c in zip(batch, alone[i]):
            if isinstance(b, RecurrentRows):
                back = b.to_single(j)
                assert back.left_padding is None and back.lengths is None
                for x, y in zip(back.cache, c.cache):
                    assert x.shape == y.shape
                    np.testing.assert_allclose(np.array(x), np.array(y), atol=1e-5)


@pytest.mark.parametrize("name", HYBRID)
def test_hybrid_sequences_joining_at_different_steps_are_exact(name):
    """Seven sequences of different prompt lengths, plain, drafting at a fixed width of 4, at 7
    with lookup, lookup alone and `auto`, joining at different steps with their prompts in
    chunks: each equals mlx-lm's greedy output alone, token for token."""
    adapter = hybrid(name)
    rng = random.Random(4)
    vocab = adapter.vocab_size
    oracles = Oracles(vocab)
    shared = Correction(decay=0.9)
    kinds = [(FixedWidth(4), False), (FixedWidth(1), False), (None, True),
             (FixedWidth(7), True), (FixedWidth(4), False), (FixedWidth(16), True), (None, False)]
    arrivals, refs, truths = {}, {}, {}
    for k, (policy, lookup) in enumerate(kinds):
        n = rng.randint(3, 30)
        prompt = [rng.randrange(vocab - 1) for _ in range(n)]
        if k % 3 == 2:     # the prompt, its continuation, the prompt: the lookup matches
            prompt = prompt + mlx_lm_greedy(adapter.model, prompt, 20) + prompt
        max_tokens = rng.randint(16, 36)
        refs[k] = (mlx_lm_greedy(adapter.model, prompt, max_tokens), "length")
        truths[k] = (len(prompt), mlx_lm_greedy(adapter.model, prompt, max_tokens + 16))
        policy = auto_policy(shared) if policy is None else policy
        arrivals.setdefault([0, 0, 1, 3, 4, 6, 9][k], []).append(
            (k, Request(prompt, max_tokens, policy=policy, lookup=lookup)))
    engine = Engine(adapter, oracles, planner=Planner(), prefill_step_size=8)
    out = run(engine, arrivals, budget=10, before_add=lambda k: oracles.expect(*truths[k]))
    for k, ref in refs.items():
        assert out[k] == ref, f"{name}: sequence {k}"
    assert engine.caches.cache is None and not engine.rows
    steps = [c for s in engine.stats.values() for c in s.steps]
    assert any(c.source == "drafter" and 0 < c.accepted < c.width - 1 for c in steps)
    assert any(c.source == "lookup" and c.accepted for c in steps)
    assert any(c.width == 4 for c in steps) and max(n for n, _, _ in engine.history) >= 5


def test_seeded_sampling_equals_alone():
    """The same seed draws the same tokens alone and batched beside others, on a hybrid target
    with a (random) drafter: plain runs, drafter and lookup cycles, each rolled back."""
    adapter = hybrid("qwen3_5")
    drafter = random_drafter(drafter_args(block_size=8, layer_ids=FEATURES))
    engine = assert_seeded_batch_equals_alone(adapter, drafter, 24)
    assert any(c.source == "drafter" for s in engine.stats.values() for c in s.steps)


def test_cancelled_sequence_leaves_others_exact():
    adapter = hybrid("qwen3_next")
    drafter = random_drafter(drafter_args(block_size=8, layer_ids=FEATURES))
    rng = random.Random(5)
    vocab = adapter.vocab_size
    prompts = [[rng.randrange(vocab - 1) for _ in range(n)] for n in (5, 17, 9, 24)]
    arrivals = {0: [(k, Request(p, 24, policy=FixedWidth(2 + 2 * k), lookup=k % 2 == 1))
                    for k, p in enumerate(prompts)]}
    out = run(Engine(adapter, drafter, planner=Planner()), arrivals, cancel_at={4: [1]})
    assert out[1][1] == CANCELLED and 0 < len(out[1][0]) < 24
    for k in (0, 2, 3):
        assert out[k] == (mlx_lm_greedy(adapter.model, prompts[k], 24), "length"), k


def test_state_kept_on_leaving_resumes_exactly():
    """A hybrid sequence's DecodeState (its recurrent rows out of the batch, `keep_state` /
    `pop_state`) starts a prompt that extends it, in another batch: exact, and its prefix is
    not prefilled again."""
    adapter = hybrid("qwen3_5")
    drafter = random_drafter(drafter_args(block_size=8, layer_ids=FEATURES))
    rng = random.Random(12)
    vocab = adapter.vocab_size
    prompt = [rng.randrange(vocab - 1) for _ in range(20)]
    others = [Request([rng.randrange(vocab - 1) for _ in range(9)], 12, policy=FixedWidth(3))
              for _ in range(2)]
    engine = Engine(adapter, drafter, planner=Planner())
    out = run(engine, {0: [(0, Request(prompt, 10, policy=FixedWidth(4), keep_state=True)),
                           (1, others[0])], 2: [(2, others[1])]})
    state = engine.pop_state(0)
    assert state is not None and state.tokens == prompt + out[0][0][:-1]
    follow = prompt + out[0][0] + [5, 6, 7]
    cached = len(state.tokens)
    engine = Engine(adapter, drafter, planner=Planner())
    out2 = run(engine, {0: [(0, Request(follow, 20, policy=FixedWidth(5), state=state)),
                            (1, copy.deepcopy(others[0]))]})
    assert out2[0] == (mlx_lm_greedy(adapter.model, follow, 20), "length")
    assert engine.stats[0].cached_tokens == cached


def test_a_checkpoint_in_the_prompt_is_kept_and_resumes_exactly():
    """`Request.checkpoint`: the prefill stops there to keep a copy of the state (a hybrid
    state cannot be trimmed back to it); a prompt that parts from the first one there starts
    from that copy, exactly, with the checkpoint's prefix not prefilled again."""
    adapter = hybrid("qwen3_5")
    drafter = random_drafter(drafter_args(block_size=8, layer_ids=FEATURES))
    rng = random.Random(13)
    vocab = adapter.vocab_size
    prompt = [rng.randrange(vocab - 1) for _ in range(30)]
    engine = Engine(adapter, drafter, planner=Planner())
    run(engine, {0: [(0, Request(prompt, 6, policy=FixedWidth(4), keep_state=True,
                                 checkpoint=21))]}, budget=8)
    kept = engine.pop_checkpoint(0)
    assert kept is not None and kept.tokens == prompt[:21]
    assert engine.pop_state(0).tokens[:30] == prompt
    follow = prompt[:21] + [7, 8, 9, 10]
    engine = Engine(adapter, drafter, planner=Planner())
    out = run(engine, {0: [(0, Request(follow, 12, policy=FixedWidth(4), state=kept))]})
    assert out[0] == (mlx_lm_greedy(adapter.model, follow, 12), "length")
    assert engine.stats[0].cached_tokens == 21


def test_memory_returns_to_idle_after_a_burst():
    adapter = hybrid("qwen3_next")
    drafter = random_drafter(drafter_args(block_size=8, layer_ids=FEATURES))
    assert_burst_returns_to_idle(adapter, drafter, 30, 16)
