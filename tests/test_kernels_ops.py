"""The MLX-ops twins of the two DFlash 2 kernels against a numpy transcription of the DFlash 2
maths, and the choice of kernel path."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dflash2_mlx.model import kernels
from dflash2_mlx.model.drafter import DecoderLayer, DynamicConv
from dflash2_mlx.model.kernels import path_walk, path_walk_ops, resolve_kernel_path, short_conv

RNG = np.random.default_rng(0)


# ------------------------------------------------------------------ the DFlash 2 maths, in numpy

def spec_conv_side(y, dyn, base, G):
    """conv_side(y)_t = sum_tap coef[tap, :] * y_{t-tap}, coef[tap, c] = base[tap, c] +
    dyn[t, tap, c // G]; row 0 reads zeros. y [B, L, H], dyn [B, L, K, H/G], base [K, H]."""
    B, L, H = y.shape
    out = np.zeros((B, L, H))
    for b in range(B):
        for t in range(L):
            for tap in range(base.shape[0]):
                if t - tap < 0:
                    continue
                for c in range(H):
                    coef = base[tap, c] + dyn[b, t, tap, c // G]
                    out[b, t, c] += coef * y[b, t - tap, c]
    return out


def spec_walk(cand, U, h_proj, P, Q, anchor, temperature=0.0, uniforms=None):
    """S_t(a, b) = U_t(b) + sum_r P[a, r] g_t[r] Q[b, r] over token ids; the predecessor of row 0
    is the anchor. Greedy: argmax; sampling: q_t = softmax(S_t(prev, .) / T), drawn by the
    inverse CDF of the uniform. cand/U [B, L, K], h_proj (g) [B, L, R], P/Q [V, R], anchor [B]."""
    B, L, K = cand.shape
    ids, qs = np.zeros((B, L), np.int64), np.zeros((B, L, K))
    for b in range(B):
        prev = anchor[b]
        for t in range(L):
            S = np.array([U[b, t, j] + np.sum(P[prev] * h_proj[b, t] * Q[cand[b, t, j]])
                          for j in range(K)])
            if uniforms is None:
                j = int(np.argmax(S))
            else:
                q = np.exp((S - S.max()) / temperature)
                q /= q.sum()
                qs[b, t] = q
                j = min(int(np.sum(np.cumsum(q) <= uniforms[b, t])), K - 1)
            prev = cand[b, t, j]
            ids[b, t] = prev
    return ids, qs


# ------------------------------------------------------------------ short convolution

@pytest.mark.parametrize("L", [1, 2, 5, 16])
@pytest.mark.parametrize("taps", [2, 3])
def test_short_conv_ops_matches_spec(L, taps):
    B, H, G = 2, 48, 16
    y, res = RNG.normal(size=(B, L, H)), RNG.normal(size=(B, L, H))
    dyn, base = RNG.normal(size=(B, L, taps, H // G)), RNG.normal(size=(taps, H))
    want = spec_conv_side(y, dyn, base, G)
    args = [mx.array(a, mx.float32) for a in (y, dyn, base)]
    np.testing.assert_allclose(np.array(kernels.short_conv_ops(*args)), want, rtol=1e-5,
                               atol=1e-5)
    fused = short_conv(*args, residual=mx.array(res, mx.float32), path="ops")  # compiled
    np.testing.assert_allclose(np.array(fused), want + res, rtol=1e-5, atol=1e-5)


def test_conv_sublayer_matches_spec():
    """x + conv_1(sublayer(conv_0(u))), u = norm(x), both sides' taps from u (the drafter)."""
    B, L, H, G, K = 2, 6, 32, 8, 2
    conv = DynamicConv(H, K, G)
    conv.base_kernel = mx.array(RNG.normal(size=(2, K, H)), mx.float32)
    conv.kernel_projection.weight = mx.array(0.3 * RNG.normal(size=(2 * K * H // G, H)),
                                             mx.float32)
    x = RNG.normal(size=(B, L, H))
    norm = lambda a: a * 0.5
    got = DecoderLayer._conv_sublayer(mx.array(x, mx.float32), norm, conv, mx.tanh)
    u = 0.5 * x
    dyn = (u @ np.array(conv.kernel_projection.weight).T).reshape(B, L, 2, K, H // G)
    base = np.array(conv.base_kernel)
    inner = spec_conv_side(u, dyn[:, :, 0], base[0], G)
    want = x + spec_conv_side(np.tanh(inner), dyn[:, :, 1], base[1], G)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=1e-4)


def test_identity_initialisation_is_the_identity():
    """base[:, 0] = 1, base[:, 1] = 0, kernel_projection = 0 (the published initialisation)."""
    y = mx.array(RNG.normal(size=(1, 4, 32)), mx.float32)
    base = mx.array(np.stack([np.ones(32), np.zeros(32)]), mx.float32)
    out = short_conv(y, mx.zeros((1, 4, 2, 2)), base, path="ops")
    np.testing.assert_array_equal(np.array(out), np.array(y))


# ------------------------------------------------------------------ path walk

def walk_problem(B, L, K=16, R=24, V=300, seed=0):
    rng = np.random.default_rng(seed)
    cand = np.stack([[rng.choice(V, K, replace=False) for _ in range(L)] for _ in range(B)])
    U = 2 * rng.normal(size=(B, L, K))
    g = rng.normal(size=(B, L, R)) / np.sqrt(R)
    P, Q = rng.normal(size=(V, R)), rng.normal(size=(V, R))
    anchor = rng.integers(0, V, B)
    return cand, U, g, P, Q, anchor


def ops_args(cand, U, g, P, Q, anchor):
    """The ops twin's inputs, gathered as the drafter gathers them: codebook rows of cand."""
    f = lambda a: mx.array(a, mx.float32)
    return (mx.array(cand, mx.uint32), f(U), f(g), f(P[cand]), f(Q[cand]), f(P[anchor]))


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("L", [1, 2, 8, 16])
def test_path_walk_ops_greedy_matches_spec(L, B):
    problem = walk_problem(B, L, seed=L + B)
    want, _ = spec_walk(*problem)
    ids, q = path_walk_ops(*ops_args(*problem))
    assert q is None and ids.dtype == mx.int32
    np.testing.assert_array_equal(np.array(ids), want)
    ids, _ = path_walk(*ops_args(*problem), path="ops")            # compiled dispatch
    np.testing.assert_array_equal(np.array(ids), want)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
@pytest.mark.parametrize("L", [1, 8, 16])
def test_path_walk_ops_sampling_matches_spec(L, temperature):
    B = 3
    problem = walk_problem(B, L, seed=L)
    u = np.random.default_rng(L).uniform(size=(B, L)).astype(np.float32)
    want_ids, want_q = spec_walk(*problem, temperature, u)
    ids, q = path_walk(*ops_args(*problem), temperature, mx.array(u), path="ops")
    np.testing.assert_array_equal(np.array(ids), want_ids)
    np.testing.assert_allclose(np.array(q), want_q, rtol=1e-4, atol=1e-6)


def test_path_walk_ops_first_maximum_on_ties():
    B, L, K = 2, 6, 16
    cand = np.arange(B * L * K).reshape(B, L, K)
    U = np.tile(np.array([0, 3, 1, 3, 3] + [0] * 11, float), (B, L, 1))
    problem = (cand, U, np.zeros((B, L, 4)), np.ones((B * L * K, 4)), np.ones((B * L * K, 4)),
               np.zeros(B, int))
    ids, _ = path_walk_ops(*ops_args(*problem))
    np.testing.assert_array_equal(np.array(ids), cand[..., 1])


def test_sampling_needs_uniforms():
    args = ops_args(*walk_problem(1, 2))
    with pytest.raises(ValueError, match="uniforms"):
        path_walk(*args, 1.0, None, path="ops")


# ------------------------------------------------------------------ choosing the path

def test_resolve_kernel_path(monkeypatch):
    monkeypatch.delenv(kernels.KERNEL_ENV, raising=False)
    auto = "metal" if kernels.metal_usable() else "ops"
    assert resolve_kernel_path() == auto
    assert resolve_kernel_path("auto") == auto
    assert resolve_kernel_path("ops") == "ops"
    assert resolve_kernel_path("stock") == "ops"       # "ops" is the older name of "stock"
    monkeypatch.setenv(kernels.KERNEL_ENV, "ops")
    assert resolve_kernel_path() == "ops"
    assert resolve_kernel_path("auto") == "ops"        # "auto" defers to the environment
    monkeypatch.setenv(kernels.KERNEL_ENV, "auto")
    assert resolve_kernel_path() == auto


def test_resolve_kernel_path_rejects_bad_values(monkeypatch):
    monkeypatch.delenv(kernels.KERNEL_ENV, raising=False)
    with pytest.raises(ValueError, match="kernels: 'cuda' is not one of auto, stock, metal"):
        resolve_kernel_path("cuda")
    monkeypatch.setenv(kernels.KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match=r"\$DFLASH2_KERNELS: 'fast'"):
        resolve_kernel_path()
    assert resolve_kernel_path("ops") == "ops"         # the argument wins over the env var


@pytest.mark.metal
@pytest.mark.skipif(kernels.metal_usable(), reason="Metal is available here")
def test_forcing_metal_without_metal_is_a_clear_error(monkeypatch):
    monkeypatch.delenv(kernels.KERNEL_ENV, raising=False)
    with pytest.raises(RuntimeError, match="Metal is not available.*kernels='stock'"):
        resolve_kernel_path("metal")
    monkeypatch.setenv(kernels.KERNEL_ENV, "metal")
    with pytest.raises(RuntimeError, match="Metal is not available"):
        resolve_kernel_path()
    y = mx.zeros((1, 2, 32))
    with pytest.raises(RuntimeError, match="needs Metal.*kernels='stock'"):   # called directly
        short_conv(y, mx.zeros((1, 2, 2, 2)), mx.zeros((2, 32)), path="metal")


@pytest.mark.metal
def test_metal_sources_ship_as_package_data():
    from dflash2_mlx.model.kernels import metal

    for name in ("short_conv", "path_walk"):
        header, body = metal.kernel_source(name)
        assert "thread_position_in_grid" in body or "thread_index_in_simdgroup" in body
        assert metal.kernel_spec(name)["source"] == body
