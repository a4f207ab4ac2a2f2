"""Drafter forward pass: context cache, masks, convolution and selector behave as DFlash /
DFlash 2 define them."""

import mlx.core as mx
import numpy as np
import pytest

from dflash2_mlx.model.drafter import Drafter
from fixtures import drafter_args, random_drafter

F = 2 * 64        # two target layers of hidden 64


def run(drafter, x, feats_chunks):
    """Feed context features in chunks (one per cycle), return the block's hidden states."""
    cache = drafter.make_cache()
    for chunk in feats_chunks[:-1]:
        drafter(x, chunk, cache)
    return drafter(x, feats_chunks[-1], cache)


@pytest.mark.parametrize("kw", [dict(), dict(dflash2=False),
                                dict(layer_types=("sliding_attention",) * 2, sliding_window=5)])
def test_context_in_pieces_equals_context_at_once(kw):
    drafter = random_drafter(drafter_args(**kw), seed=1)
    mx.random.seed(0)
    x, feats = mx.random.normal((1, 8, 64)), mx.random.normal((1, 40, F))
    whole = run(drafter, x, [feats])
    pieces = run(drafter, x, [feats[:, :13], feats[:, 13:14], feats[:, 14:33], feats[:, 33:]])
    assert mx.allclose(whole, pieces, atol=1e-5)
    # many small appends grow the cache past its pre-allocation step, still equal
    chunks = [feats[:, i : i + 3] for i in range(0, 40, 3)] * 25
    long = mx.concatenate(chunks, axis=1)
    assert long.shape[1] > 2 * drafter.make_cache()[0].step
    assert mx.allclose(run(drafter, x, [long]), run(drafter, x, chunks), atol=1e-4)


def test_sliding_window_hides_old_context_only():
    drafter = random_drafter(drafter_args(layer_types=("sliding_attention",) * 2,
                                          sliding_window=6), seed=2)
    mx.random.seed(1)
    x, feats = mx.random.normal((1, 4, 64)), mx.random.normal((1, 20, F))
    base = run(drafter, x, [feats])
    old = feats.at[:, :14].add(5.0)          # rows a block of 4 at position 20 cannot see
    assert mx.allclose(base, run(drafter, x, [old]), atol=1e-5)
    recent = feats.at[:, 17].add(5.0)        # visible to every block row (20 - 17 < 6)
    assert not mx.allclose(base[:, 0], run(drafter, x, [recent])[:, 0], atol=1e-3)
    # row 0 (position 20) sees position 15 (20 - 15 < 6), row 1 does not; a second layer
    # would mix rows, so check with a one-layer drafter
    edge = feats.at[:, 15].add(5.0)
    one = random_drafter(drafter_args(layers=1, layer_types=("sliding_attention",),
                                      sliding_window=6, dflash2=False), seed=3)
    a, b = run(one, x, [feats]), run(one, x, [edge])
    assert not mx.allclose(a[:, 0], b[:, 0], atol=1e-4)
    assert mx.allclose(a[:, 1:], b[:, 1:], atol=1e-5)


def test_bidirectional_unless_causal():
    mx.random.seed(2)
    x, feats = mx.random.normal((1, 6, 64)), mx.random.normal((1, 10, F))
    later = x.at[:, 4].add(3.0)
    bi = random_drafter(drafter_args(dflash2=False), seed=4)
    assert not mx.allclose(run(bi, x, [feats])[:, 1], run(bi, later, [feats])[:, 1], atol=1e-4)
    causal = random_drafter(drafter_args(dflash2=False, is_causal=True), seed=4)
    a, b = run(causal, x, [feats]), run(causal, later, [feats])
    assert mx.allclose(a[:, :4], b[:, :4], atol=1e-5)
    assert not mx.allclose(a[:, 4:], b[:, 4:], atol=1e-4)


def test_identity_convolution_is_plain_dflash():
    """Trainers initialise the conv as identity (base tap 0 = 1, tap 1 = 0, projection 0):
    then a DFlash 2 layer computes exactly what a DFlash layer with the same weights does."""
    args2 = drafter_args(dflash2=True)
    d2 = Drafter(args2)
    for layer in d2.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.base_kernel = mx.zeros_like(conv.base_kernel).at[:, 0].add(1.0)
            conv.kernel_projection.weight = mx.zeros_like(conv.kernel_projection.weight)
    d1 = Drafter(drafter_args(dflash2=False))
    shared = {k: v for k, v in dict(_flat(d2)).items() if k in dict(_flat(d1))}
    d1.load_weights(list(shared.items()))
    mx.random.seed(3)
    x, feats = mx.random.normal((1, 8, 64)), mx.random.normal((1, 12, F))
    assert mx.allclose(run(d1, x, [feats]), run(d2, x, [feats]), atol=1e-5)


def test_convolution_mixes_previous_row_only():
    """With the dynamic conv, block row t depends on row t-1 before attention; the anchor row
    0 reads zeros above it. In a causal one-layer drafter, row 0 ignores later rows."""
    d = random_drafter(drafter_args(layers=1, is_causal=True,
                                    layer_types=("full_attention",)), seed=5)
    mx.random.seed(4)
    x, feats = mx.random.normal((1, 5, 64)), mx.random.normal((1, 6, F))
    a = run(d, x, [feats])
    b = run(d, x.at[:, 2].add(2.0), [feats])
    assert mx.allclose(a[:, :2], b[:, :2], atol=1e-5)
    assert not mx.allclose(a[:, 2:], b[:, 2:], atol=1e-4)


def test_output_multiplier_and_softcap():
    d = Drafter(drafter_args(output_multiplier=0.5, final_logit_softcapping=3.0))
    h = mx.random.normal((1, 2, 64))
    head = lambda t: t @ mx.ones((64, 10)) * 4
    out = np.array(d.logits(h, head))
    expected = np.tanh(np.array(head(h)) * 0.5 / 3.0) * 3.0
    assert np.allclose(out, expected, atol=1e-5) and np.abs(out).max() <= 3.0


def test_selector_walk_uses_pair_scores():
    """Greedy walk = argmax of U_t(b) + P[prev] . (g_t * Q[b]) with the anchor first."""
    args = drafter_args()
    d = random_drafter(args, seed=6)
    sel = d.candidate_selector
    mx.random.seed(5)
    h, logits = mx.random.normal((1, 5, 64)), mx.random.normal((1, 5, 384)) * 3
    anchor = mx.array([7])
    ids, cand, q = sel.walk(h, logits, anchor, 0.0, None)
    assert q is None
    P, Q = np.array(sel.predecessor_codebook.weight), np.array(sel.successor_codebook.weight)
    g, lg = np.array(sel.hidden_projection(h))[0], np.array(logits)[0]
    prev = 7
    for t in range(5):
        top = np.argsort(-lg[t])[:16]
        scores = lg[t, top] + (P[prev] * g[t] * Q[top]).sum(-1)
        prev = int(top[np.argmax(scores)])
        assert int(ids[0, t]) == prev, t


def _flat(module):
    from mlx.utils import tree_flatten
    return tree_flatten(module.parameters())


def test_the_kernel_path_reaches_every_kernel_call():
    """The path is set once on the drafter and held by the modules that call the kernels
    (it used to be threaded through four layers of calls)."""
    from dflash2_mlx.model.drafter import DynamicConv
    from dflash2_mlx.model.selector import CandidateSelector
    from dflash2_mlx.model.kernels import metal_usable

    drafter = random_drafter(drafter_args(dflash2=True), seed=0)
    users = [m for _, m in drafter.named_modules()
             if isinstance(m, (DynamicConv, CandidateSelector))]
    assert users and all(m.path == "ops" for m in users) and drafter.kernels == "ops"
    if metal_usable():
        return
    drafter.kernels = "metal"
    assert all(m.path == "metal" for m in users) and drafter.kernels == "metal"
    x = mx.random.normal((1, 4, drafter.args.hidden_size))
    feats = mx.random.normal((1, 3, 2 * drafter.args.hidden_size))
    with pytest.raises(RuntimeError, match="Metal"):      # the conv call got the new path
        mx.eval(drafter(x, feats, drafter.make_cache()))
