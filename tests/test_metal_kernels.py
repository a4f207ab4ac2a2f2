"""The Metal kernel sources, run as C++ on the CPU (tests/metal_harness.py), against the MLX-ops
twins of metal_kernels/ops.py.

The harness is fed exactly what metal_kernels/metal.py feeds MLX: `metal.kernel_spec` (the
.metal files split into header and body, names, flags) and `metal.conv_launch` /
`metal.walk_launch` (inputs, template, grid, threadgroup, output shapes and dtypes).
"""

from __future__ import annotations

import shutil

import mlx.core as mx
import numpy as np
import pytest

from dflash2_mlx.model.kernels import metal
from dflash2_mlx.model.kernels import (metal_usable, pair_lattice, path_walk, path_walk_ops, short_conv,
                                 short_conv_ops)

import metal_harness as mh

pytestmark = [pytest.mark.metal, pytest.mark.rows]

LENGTHS = [1, 2, 8, 16]
BATCHES = [1, 3]
H, GROUP = 592, 16            # 592 = 2 * 256 + 80: the last threadgroup along H is partial
K, R = 16, 64
ULP = {mx.float16: 2.0 ** -10, mx.bfloat16: 2.0 ** -7}


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    """Where the harness caches its g++ builds, one per source text, for the session."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is needed to run the Metal sources on the CPU")
    return tmp_path_factory.mktemp("metal_harness")


cpu_kernel = mh.cpu_kernel


def f32(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32))


# ------------------------------------------------------------------ short convolution

def conv_inputs(B, L, dtype, seed):
    k = iter(mx.random.split(mx.random.key(seed), 4))
    y = mx.random.normal((B, L, H), key=next(k)).astype(dtype)
    dyn = (0.5 * mx.random.normal((B, L, 2, H // GROUP), key=next(k))).astype(dtype)
    base = mx.random.normal((2, H), key=next(k)).astype(dtype)
    residual = mx.random.normal((B, L, H), key=next(k)).astype(dtype)
    return y, dyn, base, residual


def run_conv(kernel, y, dyn, base, residual):
    return kernel(**metal.conv_launch(y, dyn, base, residual))[0]


def check_conv(out, y, dyn, base, residual):
    """A kernel's output vs the ops twin: float32 within rounding; 16-bit dtypes within 1 ulp of
    the twin evaluated in float32 (the kernel accumulates in float32) and close to the 16-bit
    twin."""
    assert out.dtype == y.dtype and out.shape == y.shape
    twin = short_conv_ops(y, dyn, base, residual)
    if y.dtype == mx.float32:
        np.testing.assert_allclose(f32(out), f32(twin), rtol=1e-5, atol=1e-5)
        return
    up = [None if a is None else a.astype(mx.float32) for a in (y, dyn, base, residual)]
    exact = f32(short_conv_ops(*up))
    np.testing.assert_allclose(f32(out), exact, rtol=ULP[y.dtype], atol=1e-6)
    scale = np.abs(exact).max()
    np.testing.assert_allclose(f32(out), f32(twin), rtol=0, atol=8 * ULP[y.dtype] * scale)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("B", BATCHES)
@pytest.mark.parametrize("L", LENGTHS)
def test_short_conv_matches_ops(workdir, L, B, fused, dtype):
    y, dyn, base, residual = conv_inputs(B, L, dtype, seed=L * 10 + B)
    residual = residual if fused else None
    check_conv(run_conv(cpu_kernel("short_conv", workdir), y, dyn, base, residual), y, dyn, base,
               residual)


def test_short_conv_reads_strided_inputs_in_place(workdir):
    """ensure_row_contiguous=False: the drafter's `dyn[:, :, side]` slices, an offset base and a
    transposed y are read through their strides, not copied."""
    B, L = 3, 8
    y, dyn, base, residual = conv_inputs(B, L, mx.float32, seed=7)
    taps = np.array(mx.random.normal((B, L, 2, 2, H // GROUP), key=mx.random.key(8)))
    bases = np.array(mx.random.normal((2, 2, H), key=mx.random.key(9)))
    y_t = np.ascontiguousarray(np.array(y).transpose(0, 2, 1)).transpose(0, 2, 1)  # [B, L, H]
    launch = metal.conv_launch(y, mx.array(taps[:, :, 1]), mx.array(bases[1]), residual)
    launch["inputs"] = [y_t, taps[:, :, 1], bases[1], np.array(residual)]
    assert not taps[:, :, 1].flags.c_contiguous and y_t.strides[2] != 4
    out = cpu_kernel("short_conv", workdir)(**launch)[0]
    twin = short_conv_ops(y, mx.array(taps[:, :, 1]), mx.array(bases[1]), residual)
    np.testing.assert_allclose(f32(out), f32(twin), rtol=1e-5, atol=1e-5)


def test_short_conv_more_taps_and_mixed_dtypes(workdir):
    """K = 3 taps; float32 taps and base with a float16 signal (the kernel converts each)."""
    B, L = 3, 8
    keys = mx.random.split(mx.random.key(11), 3)
    y = mx.random.normal((B, L, H), key=keys[0]).astype(mx.float16)
    dyn = mx.random.normal((B, L, 3, H // GROUP), key=keys[1])
    base = mx.random.normal((3, H), key=keys[2])
    out = cpu_kernel("short_conv", workdir)(**metal.conv_launch(y, dyn, base, None))[0]
    exact = f32(short_conv_ops(y.astype(mx.float32), dyn, base))
    assert out.dtype == mx.float16
    np.testing.assert_allclose(f32(out), exact, rtol=ULP[mx.float16], atol=1e-6)


# ------------------------------------------------------------------ path walk

def walk_inputs(B, L, dtype, seed, k=K, r=R):
    keys = iter(mx.random.split(mx.random.key(seed), 7))
    cand = mx.random.randint(0, 50_000, (B, L, k), key=next(keys)).astype(mx.uint32)
    unary = (3 * mx.random.normal((B, L, k), key=next(keys))).astype(dtype)
    g = (mx.random.normal((B, L, r), key=next(keys)) / r ** 0.5).astype(dtype)
    pred = mx.random.normal((B, L, k, r), key=next(keys)).astype(dtype)
    succ = mx.random.normal((B, L, k, r), key=next(keys)).astype(dtype)
    anchor = mx.random.normal((B, r), key=next(keys)).astype(dtype)
    uniforms = mx.random.uniform(shape=(B, L), key=next(keys))
    return (cand, unary, g, pred, succ, anchor), uniforms


def run_walk(kernel, args, temperature=0.0, uniforms=None, chunk=None):
    """The kernel path of `metal.path_walk_metal`, on the harness."""
    first, lattice = pair_lattice(*args[1:])
    launch = metal.walk_launch(args[0], first, lattice, temperature, uniforms)
    if chunk is not None:
        launch["template"] = [(n, chunk if n == "CHUNK" else v) for n, v in launch["template"]]
    ids, q = kernel(**launch)
    return ids, (q if uniforms is not None else None)


def check_walk(kernel, args, temperature=0.0, uniforms=None, chunk=None):
    """Ids identical to the ops twin's (both walk the same lattice), q within float32 rounding."""
    ids, q = run_walk(kernel, args, temperature, uniforms, chunk)
    want_ids, want_q = path_walk_ops(*args, temperature, uniforms)
    assert ids.dtype == mx.int32
    mismatch = np.argwhere(np.array(ids) != np.array(want_ids))
    assert not len(mismatch), f"ids differ at [b, t] = {mismatch[:5].tolist()}"
    if uniforms is not None:
        np.testing.assert_allclose(np.array(q), np.array(want_q), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sample"])
@pytest.mark.parametrize("B", BATCHES)
@pytest.mark.parametrize("L", LENGTHS)
def test_path_walk_matches_ops(workdir, L, B, sample):
    args, u = walk_inputs(B, L, mx.float32, seed=L * 10 + B)
    check_walk(cpu_kernel("path_walk", workdir), args, 2.0 if sample else 0.0,
               u if sample else None)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sample"])
def test_path_walk_16bit(workdir, dtype, sample):
    args, u = walk_inputs(3, 16, dtype, seed=5)
    check_walk(cpu_kernel("path_walk", workdir), args, 1.3 if sample else 0.0,
               u if sample else None)


@pytest.mark.parametrize("chunk", [1, 3])
def test_path_walk_staging_in_chunks(workdir, chunk):
    """Fewer lattice rows staged at a time than the walk has: the chunk boundaries."""
    kernel = cpu_kernel("path_walk", workdir)
    args, u = walk_inputs(3, 16, mx.float32, seed=6)
    check_walk(kernel, args, chunk=chunk)
    check_walk(kernel, args, 0.5, u, chunk=chunk)


@pytest.mark.parametrize("k", [5, 40])
def test_path_walk_other_candidate_counts(workdir, k):
    """K < 32 leaves lanes empty; K = 40 puts two candidates in a lane (J = 2)."""
    kernel = cpu_kernel("path_walk", workdir)
    args, u = walk_inputs(3, 8, mx.float32, seed=k, k=k)
    check_walk(kernel, args)
    check_walk(kernel, args, 0.9, u)


def tie_inputs(B=3, L=16, k=K, seed=3):
    """Small-integer scores: every sum is exact, so many rows hold tied maxima."""
    keys = iter(mx.random.split(mx.random.key(seed), 6))
    ints = lambda shape: mx.random.randint(-1, 2, shape, key=next(keys)).astype(mx.float32)
    cand = mx.arange(B * L * k, dtype=mx.uint32).reshape(B, L, k)
    return (cand, ints((B, L, k)), ints((B, L, 4)), ints((B, L, k, 4)), ints((B, L, k, 4)),
            ints((B, 4)))


@pytest.mark.parametrize("k", [K, 40])
def test_path_walk_ties_break_to_the_first_maximum(workdir, k):
    """Across lanes (simd_min of the tied indices) and within a lane (K = 40: 2 per lane)."""
    args = tie_inputs(k=k)
    first, lattice = pair_lattice(*args[1:])
    rows = np.concatenate([np.array(first), np.array(lattice).reshape(-1, k)])
    assert ((rows == rows.max(-1, keepdims=True)).sum(-1) > 1).mean() > 0.3  # ties are common
    check_walk(cpu_kernel("path_walk", workdir), args)


def test_path_walk_uniform_extremes(workdir):
    """u = 0 takes the first candidate, u -> 1 the last (the clamp to K - 1)."""
    args, _ = walk_inputs(3, 8, mx.float32, seed=12)
    u = mx.array(np.tile(np.array([0.0, 1 - 2 ** -24], np.float32), (3, 4)))
    kernel = cpu_kernel("path_walk", workdir)
    check_walk(kernel, args, 1.0, u)
    ids, _ = run_walk(kernel, args, 1.0, u)
    cand = np.array(args[0])
    assert (np.array(ids)[:, 0::2] == cand[:, 0::2, 0]).all()
    assert (np.array(ids)[:, 1::2] == cand[:, 1::2, K - 1]).all()


# ------------------------------------------------------------------ the harness catches bugs

def _mutate(part: str, old: str, new: str):
    def edit(spec):
        assert spec[part].count(old) >= 1, f"{old!r} not in the {part}"
        spec[part] = spec[part].replace(old, new, 1)
        return spec
    return edit


def test_broken_conv_fails(workdir):
    """One flipped operator in the tap sum: the comparison must fail."""
    broken = cpu_kernel("short_conv", workdir, _mutate("source", "acc += coef", "acc -= coef"))
    y, dyn, base, residual = conv_inputs(3, 8, mx.float32, seed=1)
    with pytest.raises(AssertionError) as failure:
        check_conv(run_conv(broken, y, dyn, base, residual), y, dyn, base, residual)
    assert str(failure.value)          # and the comparison says what differs


def test_broken_argmax_tie_break_fails(workdir):
    """`>` -> `>=` keeps the last of a lane's tied candidates (K = 40: two per lane) instead of
    the first: the tie test must fail."""
    broken = cpu_kernel("path_walk", workdir, _mutate("header", "s[j] > best", "s[j] >= best"))
    with pytest.raises(AssertionError) as failure:
        check_walk(broken, tie_inputs(k=40))
    assert str(failure.value)          # and the comparison says what differs


def test_broken_sampling_cdf_fails(workdir):
    """An inclusive prefix where the CDF needs an exclusive one: q passes, the draws fail."""
    broken = cpu_kernel("path_walk", workdir, _mutate(
        "header", "simd_prefix_exclusive_sum(lane_q)", "simd_prefix_inclusive_sum(lane_q)"))
    args, u = walk_inputs(3, 16, mx.float32, seed=4)
    with pytest.raises(AssertionError) as failure:
        check_walk(broken, args, 4.0, u)
    assert str(failure.value)          # and the comparison says what differs


def test_harness_rejects_divergent_simd_functions(workdir):
    """A SIMD-group function some lanes skip is divergence; the harness refuses it."""
    kernel = mh.metal_kernel(
        name="divergent", input_names=["x"], output_names=["out"], workdir=workdir,
        source="""
            const uint lane = thread_index_in_simdgroup;
            float v = x[lane];
            if (lane < 16) { v = simd_sum(v); }
            threadgroup_barrier(mem_flags::mem_threadgroup);
            out[lane] = v;
        """)
    x = mx.ones((32,))
    with pytest.raises(mh.LaunchError, match="divergent"):
        kernel(inputs=[x], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(32,)],
               output_dtypes=[mx.float32])


def test_harness_signature_mirrors_mlx():
    """The generated text for MLX's documented `myexp` example (float16 in and out)."""
    source = "uint elem = thread_position_in_grid.x; out[elem] = metal::exp(inp[elem]);"
    text, call, params = mh.generated_source(
        "myexp", ["inp"], ["out"], source, "", [(np.zeros(64, np.float16), mx.float16)],
        [mx.float16], [("T", mx.float32)])
    assert text.startswith(
        "template <typename T>\n"
        "[[kernel]] void custom_kernel_myexp__float_float16_t_float16_t(\n"
        "  const device float16_t* inp [[buffer(0)]],\n"
        "  device float16_t* out [[buffer(1)]],\n"
        "  uint3 thread_position_in_grid [[thread_position_in_grid]]) {\n")
    assert text.rstrip().endswith(f"decltype({call}) {call};")
    assert call.endswith("<float>")
    assert [p.kind for p in params] == ["input", "output", "attribute"]


# ------------------------------------------------------------------ on a Mac: the real kernels

on_metal = pytest.mark.skipif(not metal_usable(), reason="needs Metal and the GPU as default")


@on_metal
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("L", LENGTHS)
def test_metal_short_conv_matches_ops(L, dtype):
    y, dyn, base, residual = conv_inputs(3, L, dtype, seed=L)
    for res in (None, residual):
        check_conv(short_conv(y, dyn, base, res, path="metal"), y, dyn, base, res)


@on_metal
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sample"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
@pytest.mark.parametrize("L", LENGTHS)
def test_metal_path_walk_matches_ops(L, dtype, sample):
    args, u = walk_inputs(3, L, dtype, seed=L)
    temperature, u = (1.5, u) if sample else (0.0, None)
    ids, q = path_walk(*args, temperature, u, path="metal")
    want_ids, want_q = path_walk_ops(*args, temperature, u)
    np.testing.assert_array_equal(np.array(ids), np.array(want_ids))
    if sample:
        np.testing.assert_allclose(np.array(q), np.array(want_q), rtol=1e-5, atol=1e-6)
