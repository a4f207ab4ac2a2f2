"""The multi-row verify attention over mlx-lm's quantized KV cache
(metal_kernels/verify_attention_quant.metal), run as C++ on the CPU (tests/metal_harness.py)
against mlx-lm's `quantized_scaled_dot_product_attention` with the same mask: accuracy over
bits, group sizes, head dims and row counts, row-invariance bit for bit, and mutations the
harness must catch.

The harness is fed what metal.py feeds MLX: `kernel_spec("verify_attention_quant")` and the
`quant_attention_launch` / `merge_launch` dicts. One instantiation per dtype, head dim and bits;
group size, T, N and window are runtime values.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dflash2_mlx.model.kernels import metal, metal_usable
from dflash2_mlx.model.kernels.ops import verify_attention_quant_ops

import metal_harness as mh
from metal_harness import ULP, assert_rows_invariant, f32, mutate, workdir  # noqa: F401

pytestmark = [pytest.mark.metal, pytest.mark.rows]

SPLIT = 64      # keys per split in most tests: short contexts still cross split edges


def quant_inputs(B, Hq, Hkv, T, N, D, dtype, seed, group_size, bits):
    """q [B, Hq, T, D] and the keys and values [B, Hkv, N, D] as a QuantizedKVCache holds
    them: (packed, scales, biases) each, scales and biases in the dtype."""
    k = iter(mx.random.split(mx.random.key(seed), 3))
    q = mx.random.normal((B, Hq, T, D), key=next(k)).astype(dtype)
    kv = [mx.quantize(mx.random.normal((B, Hkv, N, D), key=next(k)).astype(dtype),
                      group_size=group_size, bits=bits) for _ in range(2)]
    return q, tuple(kv[0]), tuple(kv[1])


def run_quant(workdir, q, k, v, group_size, bits, window=0, split=SPLIT, edit=None, host=None,
              positions=None):
    """The two launches of `metal.verify_attention_quant_metal`, on the harness. `host`
    replaces the cache's six inputs by numpy views read in place (strided); positions: ragged
    rows."""
    first = metal.quant_attention_launch(q, k, v, q.shape[-1] ** -0.5, group_size, bits,
                                         window, split, positions)
    if host is not None:
        first["inputs"][1:7] = host
    o_part, ml_part = mh.cpu_kernel("verify_attention_quant", workdir, edit)(**first)
    merge = metal.merge_launch(first, o_part, ml_part)
    return mh.cpu_kernel("verify_attention_merge", workdir)(**merge)[0]


def check_quant(out, q, k, v, group_size, bits, window=0, stock_in_dtype=False, positions=None):
    """Against mlx-lm's quantized attention (`ops.verify_attention_quant_ops`) with q, scales
    and biases upcast to float32 (the kernel dequantizes and accumulates in float32): within
    rounding in float32, within 1 ulp of the dtype otherwise (the kernel rounds once). MLX's CPU
    quantized_matmul accumulates 16-bit inputs in the dtype, so stock in the dtype is compared
    only on a Mac (`stock_in_dtype`)."""
    scale = q.shape[-1] ** -0.5
    assert out.dtype == q.dtype and out.shape == q.shape
    up = lambda parts: (parts[0], *(a.astype(mx.float32) for a in parts[1:]))
    exact = f32(verify_attention_quant_ops(q.astype(mx.float32), up(k), up(v), scale,
                                           group_size, bits, window, positions))
    if q.dtype == mx.float32:
        np.testing.assert_allclose(f32(out), exact, rtol=1e-5, atol=1e-5)
        return
    np.testing.assert_allclose(f32(out), exact, rtol=ULP[q.dtype], atol=1e-3 * ULP[q.dtype])
    if stock_in_dtype:
        stock = f32(verify_attention_quant_ops(q, k, v, scale, group_size, bits, window,
                                               positions))
        np.testing.assert_allclose(f32(out), stock, rtol=0,
                                   atol=4 * ULP[q.dtype] * np.abs(exact).max())


def sweep(workdir, D, bits, dtype, Ts, split=SPLIT, Hq=4, Hkv=2):
    """Every group size that divides D (mx.quantize takes no other) and each T of `Ts` over a
    context crossing tile (32) and split edges, one of them windowed."""
    for group_size in [g for g in metal.KV_GROUPS if D % g == 0]:
        for T in Ts:
            N, window = 37 + 29 * T, (45 if group_size == 64 else 0)
            q, k, v = quant_inputs(1, Hq, Hkv, T, N, D, dtype, T + group_size, group_size, bits)
            out = run_quant(workdir, q, k, v, group_size, bits, window, split)
            check_quant(out, q, k, v, group_size, bits, window)


@pytest.mark.parametrize("bits", metal.KV_BITS)
@pytest.mark.parametrize("D", [64, 128])
def test_quant_attention_matches_mlx_lm_float32(workdir, D, bits):
    sweep(workdir, D, bits, mx.float32, Ts=(1, 3, 8, 16))


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=str)
def test_quant_attention_matches_mlx_lm_16bit(workdir, dtype):
    for i, bits in enumerate(metal.KV_BITS):
        q, k, v = quant_inputs(2, 4, 1, 5, 130, 128, dtype, i, 64, bits)
        check_quant(run_quant(workdir, q, k, v, 64, bits), q, k, v, 64, bits)


@pytest.mark.slow  # 5-37 s each (two compiles per dtype and head dim, 5-12 launches per bits)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("D", [64, 128, 256])
def test_quant_attention_sweep(workdir, D, dtype):
    """Every dtype, head dim, bits and group size, T = 1..16, 8 query heads on 2 KV heads,
    the production split (256)."""
    for bits in metal.KV_BITS:
        sweep(workdir, D, bits, dtype, Ts=(1, 2, 7, 9, 16), split=metal.ATTN_SPLIT, Hq=8)


def test_quant_attention_reads_the_cache_view_in_place(workdir):
    """mlx-lm's QuantizedKVCache as attention gets it: its update_and_fetch parts (the first N
    positions of 256-slot buffers), read here through their strides in the cache's own
    buffers, scales and biases with their own."""
    from mlx_lm.models.cache import QuantizedKVCache

    B, Hq, Hkv, T, N, D, gs, bits = 1, 4, 2, 6, 90, 64, 32, 4
    key = iter(mx.random.split(mx.random.key(3), 3))
    q = mx.random.normal((B, Hq, T, D), key=next(key))
    cache = QuantizedKVCache(gs, bits)
    k, v = cache.update_and_fetch(*(mx.random.normal((B, Hkv, N, D), key=next(key))
                                    for _ in range(2)))
    host = [np.array(buf)[:, :, :N] for buf in (*cache.keys, *cache.values)]
    assert cache.keys[0].shape[2] > N and not host[0].flags.c_contiguous
    check_quant(run_quant(workdir, q, k, v, gs, bits, host=host), q, k, v, gs, bits)


@pytest.mark.parametrize("dtype,bits,group_size", [(mx.float32, 4, 32), (mx.bfloat16, 8, 128)],
                         ids=str)
def test_quant_attention_rows_are_invariant(workdir, dtype, bits, group_size):
    """Contexts 90..105 alone, 105 among 16: rows cross tile (32) and split (64) edges."""
    q, k, v = quant_inputs(1, 4, 2, 16, 105, 128, dtype, 9, group_size, bits)
    run = lambda q, k, v, window: run_quant(workdir, q, k, v, group_size, bits, window)
    assert_rows_invariant(run, q, k, v, 0)
    assert_rows_invariant(run, q, k, v, 37)


@pytest.mark.parametrize("dtype,bits,group_size", [(mx.float32, 4, 32), (mx.bfloat16, 8, 64)],
                         ids=str)
def test_ragged_quant_attention_matches_mlx_lm(workdir, dtype, bits, group_size):
    """Batch rows of different left paddings with holes inside (the batch engine's
    `RaggedQuantizedKVCache`) against mlx-lm's quantized attention under the same mask."""
    for i, (B, T, N, window) in enumerate([(3, 16, 140, 0), (3, 1, 97, 0), (2, 5, 130, 40)]):
        q, k, v = quant_inputs(B, 4, 2, T, N, 64, dtype, 30 + i, group_size, bits)
        pos = mh.ragged_positions(B, N, T, seed=i)
        out = run_quant(workdir, q, k, v, group_size, bits, window, positions=pos)
        check_quant(out, q, k, v, group_size, bits, window, positions=pos)


def test_ragged_quant_rows_are_invariant(workdir):
    q, k, v = quant_inputs(3, 4, 2, 16, 120, 64, mx.float32, 12, 32, 4)
    pos = mh.ragged_positions(3, 120, 16, seed=4)
    run = lambda q, k, v, **kw: run_quant(workdir, q, k, v, 32, 4, **kw)
    assert_rows_invariant(run, q, k, v, positions=pos)


def test_ragged_tile_of_holes_kept_as_it_was_or_fails(workdir):
    """A batch row whose first tile is all holes (left padding 40): without the guard, the
    online softmax rescales by exp(-inf + inf), NaN."""
    broken = mutate("source", "m_new == -INFINITY ? 1.0f : metal::exp", "metal::exp")
    q, k, v = quant_inputs(3, 4, 2, 5, 100, 64, mx.float32, 2, 64, 8)
    pos = mh.ragged_positions(3, 100, 5, seed=2)
    out = run_quant(workdir, q, k, v, 64, 8, edit=broken, positions=pos)
    with pytest.raises(AssertionError, match="nan location mismatch"):
        check_quant(out, q, k, v, 64, 8, positions=pos)


@pytest.mark.slow  # 10-25 s each (every bits and group size at one head dim)
@pytest.mark.parametrize("D", [64, 128, 256])
def test_ragged_quant_attention_sweep(workdir, D):
    """Every bits and group size dividing D, T = 1..16, 4 batch rows, the production split."""
    for bits in metal.KV_BITS:
        for group_size in [g for g in metal.KV_GROUPS if D % g == 0]:
            for T in (1, 9, 16):
                N = 60 + 41 * T
                q, k, v = quant_inputs(4, 8, 2, T, N, D, mx.bfloat16, T, group_size, bits)
                pos = mh.ragged_positions(4, N, T, seed=T, pads=(0, 33, 7, 64))
                out = run_quant(workdir, q, k, v, group_size, bits, 0, metal.ATTN_SPLIT,
                                positions=pos)
                check_quant(out, q, k, v, group_size, bits, positions=pos)


def test_quant_launch_rejects_what_it_cannot_read():
    q, k, v = quant_inputs(1, 4, 2, 3, 40, 64, mx.float32, 0, 32, 4)
    with pytest.raises(ValueError, match="group 64"):   # parts of group 32 passed as 64
        metal.quant_attention_launch(q, k, v, 0.125, 64, 4)
    with pytest.raises(ValueError, match="2-bit"):
        metal.quant_attention_launch(q, k, v, 0.125, 32, 2)


@pytest.mark.parametrize("old,new,bits,group_size", [
    # 8-bit values unpacked at 4-bit offsets
    ("float((word >> (j * BITS)) & QMASK)", "float((word >> (j * 4)) & QMASK)", 8, 64),
    # every word scaled by the first group of its chunk
    ("const int gi = d0 / group_size;", "const int gi = (c) * DC / group_size;", 4, 32),
    # values dequantized with the keys' scales
    ("v_strides, v_scales, v_scales_strides", "v_strides, k_scales, k_scales_strides", 4, 64),
], ids=["shift", "group", "scales"])
def test_broken_dequantization_fails(workdir, old, new, bits, group_size):
    q, k, v = quant_inputs(1, 4, 2, 5, 100, 64, mx.float32, 2, group_size, bits)
    out = run_quant(workdir, q, k, v, group_size, bits, edit=mutate("source", old, new))
    with pytest.raises(AssertionError, match="Mismatched"):
        check_quant(out, q, k, v, group_size, bits)


# ------------------------------------------------------------------ on a Mac: the real kernel

on_metal = pytest.mark.skipif(not metal_usable(), reason="needs Metal and the GPU as default")


@on_metal
@pytest.mark.parametrize("bits", metal.KV_BITS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("D", [64, 128])
def test_metal_quant_attention_matches_mlx_lm(D, dtype, bits):
    for group_size in [g for g in metal.KV_GROUPS if D % g == 0]:
        for T in (1, 8, 16):
            q, k, v = quant_inputs(1, 8, 2, T, 1000 + T, D, dtype, T, group_size, bits)
            out = metal.verify_attention_quant_metal(q, k, v, D ** -0.5, group_size, bits)
            check_quant(out, q, k, v, group_size, bits, stock_in_dtype=True)


@on_metal
def test_metal_quant_attention_rows_are_invariant():
    q, k, v = quant_inputs(1, 8, 2, 16, 700, 128, mx.bfloat16, 1, 64, 4)
    run = lambda q, k, v: metal.verify_attention_quant_metal(q, k, v, 128 ** -0.5, 64, 4)
    assert_rows_invariant(run, q, k, v)
