"""The target's verify kernels (multi-row attention, small-M quantized matmul), run as C++ on the
CPU (tests/metal_harness.py) against MLX's stock ops: accuracy, row-invariance bit for bit, and
mutations the harness must catch.

The harness is fed exactly what metal_kernels/metal.py feeds MLX: `metal.kernel_spec` and the
`attention_launch` / `merge_launch` / `qmm_launch` dicts. Each kernel is compiled once per
instantiation (dtype, head dim or bits) and reused across shapes: T, N, M, K, group size,
window and sinks are runtime values, one instantiation serving every row count.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dflash2_mlx.model.kernels import metal, metal_usable
from dflash2_mlx.model.kernels.ops import small_m_qmm_ops, verify_attention_ops

import metal_harness as mh
from metal_harness import workdir  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.metal, pytest.mark.rows]

DTYPES = [mx.float32, mx.float16, mx.bfloat16]
SPLIT = 64      # keys per split in most tests: short contexts still cross split edges

cpu_kernel, mutate, f32, ULP = mh.cpu_kernel, mh.mutate, mh.f32, mh.ULP
assert_rows_invariant = mh.assert_rows_invariant


# ------------------------------------------------------------------ verify attention

def attention_inputs(B, Hq, Hkv, T, N, D, dtype, seed, sinks=False):
    k = iter(mx.random.split(mx.random.key(seed), 4))
    q = mx.random.normal((B, Hq, T, D), key=next(k)).astype(dtype)
    keys = mx.random.normal((B, Hkv, N, D), key=next(k)).astype(dtype)
    values = mx.random.normal((B, Hkv, N, D), key=next(k)).astype(dtype)
    sink = mx.random.normal((Hq,), key=next(k)).astype(dtype) if sinks else None
    return q, keys, values, sink


def run_attention(workdir, q, k, v, window=0, sinks=None, split=SPLIT, edit=None, merge_edit=None,
                  host=None, positions=None):
    """The two launches of `metal.verify_attention_metal`, on the harness. `host` replaces the
    (q, k, v) inputs by numpy views read in place (strided); positions: ragged rows."""
    first = metal.attention_launch(q, k, v, q.shape[-1] ** -0.5, window, sinks, split,
                                   positions)
    if host is not None:
        first["inputs"][:3] = host
    o_part, ml_part = cpu_kernel("verify_attention", workdir, edit)(**first)
    merge = metal.merge_launch(first, o_part, ml_part)
    return cpu_kernel("verify_attention_merge", workdir, merge_edit)(**merge)[0]


def check_attention(out, q, k, v, window=0, sinks=None, positions=None):
    """Against mx.fast.scaled_dot_product_attention with the same mask: float32 within rounding;
    16-bit dtypes within 1 ulp of the float32 reference of the same inputs (the kernel rounds
    once) and within a few ulps of the stock result in the dtype."""
    scale = q.shape[-1] ** -0.5
    assert out.dtype == q.dtype and out.shape == q.shape
    up = [x.astype(mx.float32) for x in (q, k, v)]
    exact = f32(verify_attention_ops(*up, scale, window, sinks, positions))
    if q.dtype == mx.float32:
        np.testing.assert_allclose(f32(out), exact, rtol=1e-5, atol=1e-5)
        return
    np.testing.assert_allclose(f32(out), exact, rtol=ULP[q.dtype], atol=1e-3 * ULP[q.dtype])
    stock = f32(verify_attention_ops(q, k, v, scale, window, sinks, positions))
    np.testing.assert_allclose(f32(out), stock, rtol=0, atol=4 * ULP[q.dtype] * np.abs(exact).max())


ATTN_CASES = [  # (B, Hq, Hkv, T, N, window, sinks): tile (32) and split (64) edges crossed
    (1, 4, 2, 16, 100, 0, False),
    (2, 2, 1, 5, 130, 40, True),
    (1, 3, 3, 1, 65, 0, True),
]


@pytest.mark.parametrize("D", [64, 128, 256])
def test_attention_matches_sdpa_float32(workdir, D):
    for i, (B, Hq, Hkv, T, N, window, sinks) in enumerate(ATTN_CASES):
        q, k, v, s = attention_inputs(B, Hq, Hkv, T, N, D, mx.float32, seed=D + i, sinks=sinks)
        check_attention(run_attention(workdir, q, k, v, window, s), q, k, v, window, s)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=str)
def test_attention_matches_sdpa_16bit(workdir, dtype):
    for i, (B, Hq, Hkv, T, N, window, sinks) in enumerate(ATTN_CASES[:2]):
        q, k, v, s = attention_inputs(B, Hq, Hkv, T, N, 128, dtype, seed=i, sinks=sinks)
        check_attention(run_attention(workdir, q, k, v, window, s), q, k, v, window, s)


@pytest.mark.slow  # 5 s each (a compile per dtype and head dim)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [64, 128, 256])
def test_attention_sweep(workdir, D, dtype):
    """Every dtype and head dim, T = 1..16, windows, sinks, the production split (256)."""
    for T in (1, 2, 7, 8, 9, 16):
        for window, sinks in ((0, False), (33, True)):
            q, k, v, s = attention_inputs(1, 8, 2, T, 40 + 37 * T, D, dtype, seed=T, sinks=sinks)
            check_attention(run_attention(workdir, q, k, v, window, s), q, k, v, window, s)
    q, k, v, s = attention_inputs(1, 4, 1, 16, 300, D, dtype, seed=1, sinks=True)
    check_attention(run_attention(workdir, q, k, v, 0, s, split=metal.ATTN_SPLIT), q, k, v, 0, s)


def test_attention_reads_the_cache_view_in_place(workdir):
    """mlx-lm's shapes as they arrive: q transposed from [B, T, Hq, D], k and v the first N
    positions of a larger preallocated cache, read through their strides."""
    B, Hq, Hkv, T, N, D, cap = 1, 4, 2, 6, 90, 64, 256
    q, k, v, _ = attention_inputs(B, Hq, Hkv, T, N, D, mx.float32, seed=3)
    q_view = np.ascontiguousarray(np.array(q).transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    cache = np.zeros((2, B, Hkv, cap, D), np.float32)
    cache[0, :, :, :N], cache[1, :, :, :N] = np.array(k), np.array(v)
    host = [q_view, cache[0, :, :, :N], cache[1, :, :, :N]]
    assert not host[1].flags.c_contiguous and not q_view.flags.c_contiguous
    check_attention(run_attention(workdir, q, k, v, host=host), q, k, v)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
def test_attention_rows_are_invariant(workdir, dtype):
    """Contexts 90..105 alone, 105 among 16: rows cross tile (32) and split (64) edges."""
    q, k, v, s = attention_inputs(1, 4, 2, 16, 105, 64, dtype, seed=9, sinks=True)
    run = lambda *a: run_attention(workdir, *a)
    assert_rows_invariant(run, q, k, v, 0, None)
    assert_rows_invariant(run, q, k, v, 37, s)


def assert_fails(workdir, edit=None, merge_edit=None, sinks=False):
    """A mutated kernel (pass 1 `edit`, merge `merge_edit`) fails the accuracy check."""
    q, k, v, s = attention_inputs(1, 4, 2, 5, 100, 64, mx.float32, seed=2, sinks=sinks)
    with pytest.raises(AssertionError, match="Mismatched"):
        check_attention(run_attention(workdir, q, k, v, 0, s, edit=edit, merge_edit=merge_edit),
                        q, k, v, 0, s)


def test_broken_attention_barrier_fails(workdir):
    """Without the barrier after staging a V chunk, lanes read other threads' stale K values."""
    broken = mutate("source", "    threadgroup_barrier(mem_flags::mem_threadgroup);\n"
                    "    for (int j = 0; j < RPS; ++j) {\n      if (active[j]) {\n"
                    "        const int i0", "    for (int j = 0; j < RPS; ++j) {\n"
                    "      if (active[j]) {\n        const int i0")
    assert_fails(workdir, edit=broken)


def test_broken_attention_head_index_fails(workdir):
    """A query row read from the wrong head of its group."""
    broken = mutate("source", "const int h = g * G + row / Tq, t = row % Tq;\n    x =",
                    "const int h = g * G + row % G, t = row % Tq;\n    x =")
    assert_fails(workdir, edit=broken)


def test_broken_merge_order_fails(workdir):
    """The sink left out of the merge: accuracy fails with sinks."""
    broken = mutate("source", "float total = has_sinks ? metal::exp(sink - M) : 0.0f;",
                    "float total = 0.0f;")
    assert_fails(workdir, merge_edit=broken, sinks=True)


def test_tiles_anchored_to_the_window_break_row_invariance(workdir):
    """Tiles that start at the first window key (which moves with T) instead of at multiples of
    32: accurate, but a row's sums group differently alone and among 16. The invariance test
    must see it."""
    broken = mutate("source", "tg_first - tg_first % BN", "tg_first")
    q, k, v, _ = attention_inputs(1, 2, 1, 16, 120, 64, mx.float32, seed=4)
    run = lambda *a: run_attention(workdir, *a, edit=broken)
    check_attention(run(q, k, v, 45, None), q, k, v, 45)
    with pytest.raises(AssertionError, match="differs alone"):
        assert_rows_invariant(run, q, k, v, 45, None)


# ------------------------------------------------------------------ ragged rows (batch engine)

RAGGED_CASES = [  # (B, Hq, Hkv, T, N, window): left pads 0, 5, 40 (a tile of holes), holes inside
    (3, 4, 2, 16, 140, 0), (3, 2, 1, 1, 97, 0), (2, 2, 2, 5, 130, 40)]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
def test_ragged_attention_matches_sdpa(workdir, dtype):
    """Batch rows of different left paddings with holes inside (`ragged_positions`) against
    stock attention under the mask `RaggedKVCache.make_mask` builds (`ops.verify_mask`)."""
    for i, (B, Hq, Hkv, T, N, window) in enumerate(RAGGED_CASES):
        q, k, v, s = attention_inputs(B, Hq, Hkv, T, N, 64, dtype, seed=20 + i, sinks=i == 1)
        pos = mh.ragged_positions(B, N, T, seed=i)
        out = run_attention(workdir, q, k, v, window, s, positions=pos)
        check_attention(out, q, k, v, window, s, positions=pos)


def test_ragged_without_holes_is_the_unpadded_kernel_bit_for_bit(workdir):
    """Positions 0..N-1 in every row: the ragged path computes what the plain one does."""
    q, k, v, s = attention_inputs(2, 4, 2, 7, 100, 64, mx.float32, seed=6, sinks=True)
    pos = mx.broadcast_to(mx.arange(100, dtype=mx.int32), (2, 100))
    assert mx.array_equal(run_attention(workdir, q, k, v, 0, s, positions=pos),
                          run_attention(workdir, q, k, v, 0, s)).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
def test_ragged_rows_are_invariant(workdir, dtype):
    """A batch row's block row alone (its slots up to its own) equals it among 16, bit for bit,
    for three batch rows of different paddings and holes."""
    q, k, v, s = attention_inputs(3, 4, 2, 16, 120, 64, dtype, seed=11, sinks=True)
    pos = mh.ragged_positions(3, 120, 16, seed=3)
    run = lambda *a, **kw: run_attention(workdir, *a, **kw)
    assert_rows_invariant(run, q, k, v, 0, s, positions=pos)


def test_ragged_holes_read_as_keys_fail(workdir):
    """A kernel that ignores the holes (left padding, rejected drafts) fails the accuracy."""
    broken = mutate("source", "(kp >= 0 && kp <= qpos[j]", "(kp <= qpos[j]")
    q, k, v, _ = attention_inputs(3, 4, 2, 5, 100, 64, mx.float32, seed=2)
    pos = mh.ragged_positions(3, 100, 5, seed=2)
    with pytest.raises(AssertionError, match="Mismatched"):
        check_attention(run_attention(workdir, q, k, v, edit=broken, positions=pos), q, k, v,
                        positions=pos)


@pytest.mark.slow  # 5 s each (a compile per dtype and head dim)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [64, 128, 256])
def test_ragged_attention_sweep(workdir, D, dtype):
    """Every dtype and head dim, T = 1..16, 4 batch rows, windows, sinks, the production split."""
    for T in (1, 2, 9, 16):
        for window, sinks in ((0, False), (33, True)):
            N = 60 + 41 * T
            q, k, v, s = attention_inputs(4, 8, 2, T, N, D, dtype, seed=T, sinks=sinks)
            pos = mh.ragged_positions(4, N, T, seed=T, pads=(0, 33, 7, 64))
            out = run_attention(workdir, q, k, v, window, s, metal.ATTN_SPLIT, positions=pos)
            check_attention(out, q, k, v, window, s, positions=pos)


# ------------------------------------------------------------------ small-M quantized matmul

def qmm_inputs(M, N, K, bits, group_size, dtype, seed, lead=()):
    k = iter(mx.random.split(mx.random.key(seed), 2))
    w, scales, biases = mx.quantize(mx.random.normal((N, K), key=next(k)).astype(dtype),
                                    group_size=group_size, bits=bits)
    x = mx.random.normal((*lead, M, K), key=next(k)).astype(dtype)
    return x, w, scales, biases


def run_qmm(kernel, x, w, scales, biases, group_size, bits):
    y = kernel(**metal.qmm_launch(x, w, scales, biases, group_size, bits))[0]
    return y.reshape(*x.shape[:-1], w.shape[0])


def check_qmm(y, x, w, scales, biases, group_size, bits, stock_in_dtype=False):
    """Against the float64 product of the dequantized weights (the kernel rounds once from a
    float32 sum) and mx.quantized_matmul of the inputs upcast to float32. MLX's CPU backend
    rounds each 16-bit weight to the dtype and accumulates in it, so stock in the dtype is
    compared only on a Mac (`stock_in_dtype`), where its GPU kernel accumulates in float32."""
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], w.shape[0])
    up = [a.astype(mx.float32) for a in (x, scales, biases)]
    deq = np.array(mx.dequantize(w, up[1], up[2], group_size=group_size, bits=bits), np.float64)
    exact = f32(x).astype(np.float64) @ deq.T
    size = np.abs(f32(x)).astype(np.float64) @ np.abs(deq).T   # the float32 sum's error scale
    tol = ULP[x.dtype] * np.abs(exact) + 64 * 2.0 ** -24 * size
    for name, want in [("exact", exact),
                       ("stock in float32", f32(small_m_qmm_ops(up[0], w, *up[1:], group_size,
                                                                bits))),
                       ("stock", f32(small_m_qmm_ops(x, w, scales, biases, group_size, bits))
                        if stock_in_dtype else None)]:
        if want is not None:
            err = np.abs(f32(y) - want)
            limit = tol if name != "stock" else 2 * tol + ULP[x.dtype] * np.abs(exact)
            assert (err <= limit).all(), f"max error {err.max():.3g} vs {name}"


QMM_CASES = [  # (M, N, K, group size): 5 or 3 groups a row, N not a multiple of 8
    (1, 20, 160, 32), (7, 20, 320, 64), (16, 12, 384, 128), (16, 8, 768, 64)]


@pytest.mark.parametrize("dtype,bits", [(mx.float32, 4), (mx.float32, 8), (mx.float16, 4),
                                        (mx.bfloat16, 8)], ids=str)
def test_qmm_matches_quantized_matmul(workdir, dtype, bits):
    kernel = cpu_kernel("small_m_qmm", workdir)
    for i, (M, N, K, gs) in enumerate(QMM_CASES):
        args = qmm_inputs(M, N, K, bits, gs, dtype, seed=i)
        check_qmm(run_qmm(kernel, *args, gs, bits), *args, gs, bits)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [4, 8])
def test_qmm_sweep(workdir, dtype, bits):
    kernel = cpu_kernel("small_m_qmm", workdir)
    for gs in (32, 64, 128):
        for M in (1, 2, 5, 8, 9, 16):
            args = qmm_inputs(M, 36, gs * 7, bits, gs, dtype, seed=M + gs)
            check_qmm(run_qmm(kernel, *args, gs, bits), *args, gs, bits)


def test_qmm_leading_dims(workdir):
    """x [B, L, K] as the target's projections pass it: B * L rows."""
    args = qmm_inputs(4, 16, 256, 4, 64, mx.float32, seed=5, lead=(2,))
    check_qmm(run_qmm(cpu_kernel("small_m_qmm", workdir), *args, 64, 4), *args, 64, 4)


@pytest.mark.parametrize("dtype,bits", [(mx.float32, 4), (mx.bfloat16, 8)], ids=str)
def test_qmm_rows_are_invariant(workdir, dtype, bits):
    """Row m of a 16-row product equals, bit for bit, the row alone (M = 1) and among 5."""
    kernel = cpu_kernel("small_m_qmm", workdir)
    x, w, scales, biases = qmm_inputs(16, 20, 320, bits, 64, dtype, seed=8)
    bits_of = lambda y: np.array(y.view(mx.uint32 if dtype == mx.float32 else mx.uint16))
    among = bits_of(run_qmm(kernel, x, w, scales, biases, 64, bits))
    for m in range(16):
        alone = bits_of(run_qmm(kernel, x[m:m + 1], w, scales, biases, 64, bits))
        assert (alone[0] == among[m]).all(), f"row {m} differs alone"
    five = bits_of(run_qmm(kernel, x[3:8], w, scales, biases, 64, bits))
    assert (five == among[3:8]).all()


def test_broken_qmm_word_index_fails(workdir):
    """8-bit values 4..7 read from the first word of the pair."""
    broken = cpu_kernel("small_m_qmm", workdir, mutate("source", "k0 / PER_WORD + wi]",
                                                       "k0 / PER_WORD]"))
    args = qmm_inputs(3, 8, 256, 8, 64, mx.float32, seed=2)
    with pytest.raises(AssertionError, match="max error"):
        check_qmm(run_qmm(broken, *args, 64, 8), *args, 64, 8)


def test_broken_qmm_group_index_fails(workdir):
    """Every lane scaled by the first group of its 256-wide block."""
    broken = cpu_kernel("small_m_qmm", workdir,
                        mutate("source", "k0 / group_size", "kb / group_size"))
    args = qmm_inputs(3, 8, 320, 4, 32, mx.float32, seed=2)
    with pytest.raises(AssertionError, match="max error"):
        check_qmm(run_qmm(broken, *args, 32, 4), *args, 32, 4)


# ------------------------------------------------------------------ on a Mac: the real kernels

on_metal = pytest.mark.skipif(not metal_usable(), reason="needs Metal and the GPU as default")


@on_metal
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [64, 128, 256])
def test_metal_attention_matches_sdpa(D, dtype):
    for T in (1, 8, 16):
        for window, sinks in ((0, False), (300, True)):
            q, k, v, s = attention_inputs(1, 8, 2, T, 1000 + T, D, dtype, seed=T, sinks=sinks)
            out = metal.verify_attention_metal(q, k, v, D ** -0.5, window, s)
            check_attention(out, q, k, v, window, s)


@on_metal
def test_metal_attention_rows_are_invariant():
    q, k, v, s = attention_inputs(1, 8, 2, 16, 700, 128, mx.bfloat16, seed=1, sinks=True)
    run = lambda q, k, v, w, s: metal.verify_attention_metal(q, k, v, 128 ** -0.5, w, s)
    assert_rows_invariant(run, q, k, v, 0, None)
    assert_rows_invariant(run, q, k, v, 300, s)


@on_metal
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_metal_qmm_matches_and_rows_are_invariant(dtype, bits):
    x, w, scales, biases = qmm_inputs(16, 512, 1024, bits, 64, dtype, seed=bits)
    y = metal.small_m_qmm_metal(x, w, scales, biases, 64, bits)
    check_qmm(y, x, w, scales, biases, 64, bits, stock_in_dtype=True)
    for m in (0, 7, 15):
        alone = metal.small_m_qmm_metal(x[m:m + 1], w, scales, biases, 64, bits)
        assert mx.array_equal(alone[0], y[m]).item()
