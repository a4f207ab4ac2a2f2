"""The two-partition top-k against a full partition; the training normaliser and host_exp's
softmax and SwiGLU (values and gradients) against MLX's own ops."""

from __future__ import annotations

import contextlib

import mlx.core as mx
import numpy as np
import pytest

from dflash2_mlx.model.topk import top_k_indices
from dflash2_mlx.train.losses import log_normaliser


@pytest.mark.parametrize("shape,k", [((37, 18241), 16), ((3, 5, 4096), 16), ((9, 1000), 8),
                                     ((4, 40), 16), ((6, 64 * 40), 1)])
def test_top_k_indices_is_the_set_of_the_k_largest(shape, k):
    rng = np.random.default_rng(sum(shape) + k)
    x = rng.normal(size=shape).astype(np.float32)
    # the largest entries crowded into one group and into the row's tail
    x[..., 128:128 + k] += 10
    x[..., -3:] += 10 * rng.integers(0, 2, size=shape[:-1] + (1,))
    got = np.sort(np.array(top_k_indices(mx.array(x), k)), -1)
    want = np.sort(np.argsort(-x, axis=-1)[..., :k], -1)
    assert got.shape == shape[:-1] + (k,)
    np.testing.assert_array_equal(got, want)


def test_log_normaliser_equals_logsumexp_and_its_gradient():
    rng = np.random.default_rng(0)
    x = mx.array((rng.normal(size=(64, 3000)) * 20).astype(np.float32))
    x[:, 7] = 200.0                         # a label's probability underflows in fp32
    w = mx.array(rng.normal(size=(64,)).astype(np.float32))

    def old(a):
        return (mx.logsumexp(a, axis=-1) * w).sum() - a[:, 3].sum()

    def new(a):
        return (log_normaliser(a)[0] * w).sum() - a[:, 3].sum()

    (v0, g0), (v1, g1) = mx.value_and_grad(old)(x), mx.value_and_grad(new)(x)
    assert float(v1) == pytest.approx(float(v0), rel=1e-6)
    np.testing.assert_allclose(np.array(g1), np.array(g0), atol=1e-6)
    logz, p = log_normaliser(x)
    np.testing.assert_allclose(np.array(logz), np.array(mx.logsumexp(x, axis=-1)), rtol=1e-6)
    np.testing.assert_allclose(np.array(p).sum(-1), 1.0, rtol=1e-5)
    # compiled (host_exp off: traced code cannot leave MLX)
    from dflash2_mlx.train import host_exp

    with host_exp.disabled():
        (v2, g2) = mx.compile(mx.value_and_grad(new))(x)
    np.testing.assert_allclose(np.array(g2), np.array(g0), atol=1e-6)


@pytest.mark.parametrize("host", [True, False])
def test_host_exp_softmax_and_swiglu_equal_mlx_with_gradients(host):
    from mlx_lm.models.activations import swiglu

    from dflash2_mlx.train import host_exp

    rng = np.random.default_rng(1)
    x, g, u, w = (mx.array(rng.normal(size=(5, 6, 300)).astype(np.float32) * s)
                  for s in (8, 3, 1, 1))

    def ours(x, g, u):
        return (host_exp.softmax(x) * w).sum() + (host_exp.swiglu(g, u)[0] * w).sum()

    def mlx(x, g, u):
        return (mx.softmax(x, axis=-1, precise=True) * w).sum() + (swiglu(g, u) * w).sum()

    with host_exp.disabled() if not host else contextlib.nullcontext():
        assert host_exp.active() == host
        v1, g1 = mx.value_and_grad(ours, argnums=(0, 1, 2))(x, g, u)
    v0, g0 = mx.value_and_grad(mlx, argnums=(0, 1, 2))(x, g, u)
    assert float(v1) == pytest.approx(float(v0), rel=1e-5)
    for a, b in zip(g1, g0):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-5)
