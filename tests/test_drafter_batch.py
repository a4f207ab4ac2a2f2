"""One drafter pass for n sequences (`Drafter.propose_batch`): every sequence's proposal is the
one it gets alone, token for token, whatever its context, width, new features, sampling and
key, and whatever shares the pass."""

import copy
import random

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import _get_classes

from dflash2_mlx.model.drafter import Draft, DraftVocab
from dflash2_mlx.model.sampling import Sampling
from dflash2_mlx.model.target import TargetAdapter
from fixtures import drafter_args, random_drafter, target_config

pytestmark = pytest.mark.rows

F = 2 * 64        # two target layers of hidden 64
SAMPLINGS = [Sampling(), Sampling(0.8), Sampling(1.0, top_p=0.9), Sampling(0.6, top_k=20)]
KINDS = {
    "dflash2": dict(),
    "dflash": dict(dflash2=False),
    "dflash2-sliding": dict(layer_types=("sliding_attention",) * 2, sliding_window=6),
    "dflash-causal": dict(dflash2=False, is_causal=True),
}


@pytest.fixture(scope="module")
def target():
    cfg = target_config("llama")
    model_class, args_class = _get_classes(cfg)
    mx.random.seed(7)
    return TargetAdapter(model_class(args_class.from_dict(cfg)))


def _feats(rng: random.Random, rows: int):
    """None, a zero-row array (as the cost calibration passes) or `rows` random rows."""
    if rows == 0:
        return rng.choice([None, mx.zeros((1, 0, F))])
    return mx.random.normal((1, rows, F), key=mx.random.key(rng.randrange(1 << 30)))


def _same(a, b, what):
    assert (a is None) == (b is None), what
    if a is not None:
        assert a.shape == b.shape, what
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5, rtol=1e-5,
                                   err_msg=what)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["greedy", "sampled", "mixed"])
def test_one_pass_equals_each_alone(target, kind, mode):
    """Seven sequences over eight passes, each with its own context length, new features
    (none, some, many), width (2 to the block) and sampling; every pass's proposals equal
    each sequence's own B=1 pass on a copy of its cache, and the caches stay equal."""
    drafter = random_drafter(drafter_args(**KINDS[kind]), seed=1)
    rng = random.Random(f"{kind} {mode}")
    n = 7
    alone = [drafter.make_cache() for _ in range(n)]
    for i, cache in enumerate(alone):                  # contexts of different lengths
        drafter(mx.zeros((1, 2, 64)), _feats(rng, 3 + 11 * i), cache)
    together = copy.deepcopy(alone)
    samplings = {"greedy": SAMPLINGS[:1], "sampled": SAMPLINGS[1:2],
                 "mixed": SAMPLINGS}[mode]
    drafted = 0
    for step in range(8):
        drafts = []
        for i in range(n):
            feats = _feats(rng, rng.choice([0, 0, 1, 3, 8]))
            width = rng.choice([2, 3, 7, 16]) if i else 16   # one at the full block
            anchor = mx.array([[rng.randrange(300)]], dtype=mx.uint32)
            drafts.append(Draft(anchor, feats, together[i], width, rng.choice(samplings),
                                mx.random.key(rng.randrange(1 << 30))))
        batched = drafter.propose_batch(target, drafts)
        for i, (d, got) in enumerate(zip(drafts, batched)):
            want = drafter.propose(target, d.anchor, d.feats, alone[i], d.width, d.sampling,
                                   d.key)
            what = f"{kind} {mode} step {step} sequence {i}"
            assert got.tokens.shape == (1, d.width - 1), what
            assert got.tokens.tolist() == want.tokens.tolist(), what
            _same(got.q, want.q, what)
            _same(got.q_ids, want.q_ids, what)
            drafted += d.width - 1
        for i in range(n):
            for a, b in zip(alone[i], together[i]):
                assert (a.start, a.offset) == (b.start, b.offset)
                _same(a.keys[..., : a.size, :], b.keys[..., : b.size, :], f"cache {i}")
    assert drafted > 200


@pytest.mark.parametrize("kind", ["dflash2", "dflash2-sliding", "dflash-causal"])
def test_padding_rows_are_invisible(kind):
    """The hidden states of a sequence's block rows in a pass of blocks padded to a wider
    one equal its pass alone (a padding row that its attention saw would change them)."""
    drafter = random_drafter(drafter_args(**KINDS[kind]), seed=2)
    rng = random.Random(0)
    widths, L = [3, 9, 16, 5], 16
    caches = [drafter.make_cache() for _ in widths]
    for i, cache in enumerate(caches):
        drafter(mx.zeros((1, 2, 64)), _feats(rng, 4 + 9 * i), cache)
    x = mx.random.normal((len(widths), L, 64), key=mx.random.key(1))
    feats = [_feats(rng, r) for r in (2, 0, 5, 1)]
    copies = copy.deepcopy(caches)
    h = drafter.blocks(x, feats, copies, widths)
    for i, w in enumerate(widths):
        want = drafter(x[i : i + 1, :w], feats[i], caches[i])
        np.testing.assert_allclose(np.array(h[i, :w]), np.array(want[0]), atol=1e-5,
                                   rtol=1e-5, err_msg=f"{kind} sequence {i}")


def test_draft_vocabulary_in_one_pass(target):
    """A drafter with its own output vocabulary: batched proposals are its token ids, the
    same as alone (greedy and sampled, with the selector and without)."""
    rng = random.Random(4)
    ids = sorted(rng.sample(range(384), 120))
    for kw in (dict(), dict(dflash2=False)):
        drafter = random_drafter(drafter_args(**kw), seed=3)
        drafter.draft_vocab = DraftVocab(ids)
        caches = [drafter.make_cache() for _ in range(3)]
        drafts = [Draft(mx.array([[7 + i]], dtype=mx.uint32), _feats(rng, 5 + i), c, w, s,
                        mx.random.key(i))
                  for i, (c, w, s) in enumerate(zip(caches, (4, 16, 2), SAMPLINGS))]
        alone = copy.deepcopy(caches)
        got = drafter.propose_batch(target, drafts)
        for d, g, cache in zip(drafts, got, alone):
            want = drafter.propose(target, d.anchor, d.feats, cache, d.width, d.sampling,
                                   d.key)
            assert g.tokens.tolist() == want.tokens.tolist()
            assert set(g.tokens[0].tolist()) <= set(ids)
            _same(g.q, want.q, "q")
            _same(g.q_ids, want.q_ids, "q_ids")
