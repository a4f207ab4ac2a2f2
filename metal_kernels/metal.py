"""The Metal kernels (Apple GPUs only): the drafter's `kernels.short_conv` and
`kernels.path_walk`, and the target's verify kernels, `verify_attention_metal` (multi-row
attention, two passes; `verify_attention_quant_metal` over mlx-lm's quantized KV cache) and
`small_m_qmm_metal` (quantized matmul of 1-16 rows).

Each kernel's source is `<name>.metal` beside this module in `metal_kernels/` (installed as the
package `dflash2_mlx.model.kernels`, read once); each `mx.fast.metal_kernel` is built at first
use and reused. Importing this module needs no Metal:
only calling a kernel does. The contracts are those of the MLX-ops twins in `ops.py`;
`tests/test_metal_kernels.py` runs these very sources as C++ on the CPU against the twins.
"""
from __future__ import annotations

import functools
from importlib import resources

import mlx.core as mx

from .ops import pair_lattice

BODY_MARKER = "// ---- kernel body ----"
CONV_THREADGROUP = 256   # threads along the channels
SIMD_WIDTH = 32          # one SIMD group walks one batch row
WALK_TILE_FLOATS = 4096  # threadgroup memory for staged lattice rows: 16 KiB
ATTN_SIMDS, ATTN_RPS = 4, 4  # verify attention: SIMD groups per threadgroup, rows per group
ATTN_SPLIT = 256         # keys per split (pass 1); fixed, so plain steps and verifies agree
ATTN_HEAD_DIMS = range(32, 257, 32)
KV_BITS, KV_GROUPS = (4, 8), (32, 64, 128)  # the quantized KV caches the attention reads
QMM_SIMDS = 2            # small-M qmm: SIMD groups per threadgroup, 4 output features each
QMM_MAX_ROWS = 16
QMM_BITS = (4, 8)

_IO = {  # input names, output names
    "short_conv": (("y", "dyn", "base", "residual"), ("out",)),
    "path_walk": (("cand", "first", "lattice", "temperature", "uniforms"), ("ids", "q")),
    "verify_attention": (("q", "k", "v", "kpos", "sinks", "params", "scale"),
                         ("o_part", "ml_part")),
    "verify_attention_merge": (("o_part", "ml_part", "sinks", "params"), ("out",)),
    "verify_attention_quant": (("q", "k", "k_scales", "k_biases", "v", "v_scales", "v_biases",
                                "kpos", "sinks", "params", "scale"), ("o_part", "ml_part")),
    "small_m_qmm": (("x", "w", "scales", "biases"), ("y",)),
}
_ROW_CONTIGUOUS = {"small_m_qmm"}  # the others read strided inputs in place
# a kernel whose body is its own followed by another's: the quantized attention defines only
# its K/V staging (verify_attention_quant.metal)
_BODY_OF = {"verify_attention_quant": "verify_attention"}


@functools.cache
def kernel_source(name: str) -> tuple[str, str]:
    """(header, body) of `metal_kernels/<name>.metal`, split at BODY_MARKER."""
    text = resources.files(__package__).joinpath(f"{name}.metal").read_text()
    header, marker, body = text.partition(BODY_MARKER)
    if not marker:
        raise RuntimeError(f"metal_kernels/{name}.metal has no {BODY_MARKER!r} line")
    return header, body


def kernel_spec(name: str) -> dict:
    """The `mx.fast.metal_kernel` arguments of kernel `name` (a key of `_IO`); the CPU test
    harness builds its stand-in from the same dict."""
    header, body = kernel_source(name)
    if name in _BODY_OF:
        body += kernel_source(_BODY_OF[name])[1]
    inputs, outputs = _IO[name]
    return dict(name=f"dflash2_{name}", input_names=list(inputs), output_names=list(outputs),
                source=body, header=header, ensure_row_contiguous=name in _ROW_CONTIGUOUS)


def _build(name: str):
    if not mx.metal.is_available():
        raise RuntimeError(f"The {name} Metal kernel needs Metal (mx.metal.is_available() is "
                           "False here); use the stock path (kernels='stock').")
    return mx.fast.metal_kernel(**kernel_spec(name))


@functools.cache
def short_conv_kernel():
    return _build("short_conv")


@functools.cache
def path_walk_kernel():
    return _build("path_walk")


@functools.cache
def verify_attention_kernels():
    return _build("verify_attention"), _build("verify_attention_merge")


@functools.cache
def verify_attention_quant_kernel():
    return _build("verify_attention_quant")


@functools.cache
def small_m_qmm_kernel():
    return _build("small_m_qmm")


def conv_launch(y: mx.array, dyn: mx.array, base: mx.array, residual: mx.array | None):
    """Arguments of the short-conv kernel call (also used by the CPU test harness)."""
    B, L, H = y.shape
    if H % dyn.shape[-1] or tuple(base.shape) != (dyn.shape[2], H):
        raise ValueError(f"short_conv: y {y.shape}, dyn {dyn.shape}, base {base.shape} do not "
                         "match [B, L, H], [B, L, K, H/G], [K, H]")
    has_residual = residual is not None
    dtype = y.dtype  # the ops twin's: y's, promoted with the residual's
    if has_residual:
        dtype = (mx.zeros((), dtype) + mx.zeros((), residual.dtype)).dtype
    return dict(
        inputs=[y, dyn, base, residual if has_residual else mx.zeros((1, 1, 1), y.dtype)],
        template=[("T", dtype), ("HAS_RESIDUAL", int(has_residual))],
        grid=(H, L, B), threadgroup=(min(H, CONV_THREADGROUP), 1, 1),
        output_shapes=[(B, L, H)], output_dtypes=[dtype])


def walk_launch(cand: mx.array, first: mx.array, lattice: mx.array, temperature: float,
                uniforms: mx.array | None):
    """Arguments of the path-walk kernel call (also used by the CPU test harness)."""
    B, L, K = cand.shape
    if K * K > WALK_TILE_FLOATS:
        raise ValueError(f"path_walk: the Metal kernel takes at most 64 candidates, got {K}")
    sample = uniforms is not None
    return dict(
        inputs=[cand, first, lattice if L > 1 else mx.zeros((1, 1, 1, 1), first.dtype),
                mx.array(temperature if sample else 1.0, mx.float32),
                uniforms.astype(mx.float32) if sample else mx.zeros((1, 1), mx.float32)],
        template=[("K", K), ("J", -(-K // SIMD_WIDTH)), ("CHUNK", WALK_TILE_FLOATS // (K * K)),
                  ("SAMPLE", int(sample))],
        grid=(SIMD_WIDTH, B, 1), threadgroup=(SIMD_WIDTH, 1, 1),
        output_shapes=[(B, L), (B, L, K) if sample else (1,)],
        output_dtypes=[mx.int32, mx.float32])


def short_conv_metal(y: mx.array, dyn: mx.array, base: mx.array,
                     residual: mx.array | None = None) -> mx.array:
    """`ops.short_conv_ops` as one kernel launch: y [B, L, H], dyn [B, L, K, H/G],
    base [K, H], residual [B, L, H] or None -> [B, L, H]."""
    return short_conv_kernel()(**conv_launch(y, dyn, base, residual))[0]


_lattice = mx.compile(pair_lattice)


def path_walk_metal(cand: mx.array, unary: mx.array, g: mx.array, pred_rows: mx.array,
                    succ_rows: mx.array, anchor_pred: mx.array, temperature: float = 0.0,
                    uniforms: mx.array | None = None):
    """`ops.path_walk_ops` as the pair lattice (one matmul) plus one walk launch over it, the
    lattice the ops twin walks (why this split: docs/kernels.md). cand [B, L, K],
    unary [B, L, K], g [B, L, R], pred_rows/succ_rows [B, L, K, R], anchor_pred [B, R],
    uniforms [B, L] or None -> ids [B, L] int32, q [B, L, K] or None."""
    first, lattice = _lattice(unary, g, pred_rows, succ_rows, anchor_pred)
    if temperature <= 0:
        uniforms = None
    ids, q = path_walk_kernel()(**walk_launch(cand, first, lattice, temperature, uniforms))
    return ids, (q if uniforms is not None else None)


# --------------------------------------------------------------------------- verify kernels

def attention_launch(q: mx.array, k: mx.array, v: mx.array, scale: float, window: int = 0,
                     sinks: mx.array | None = None, split: int = ATTN_SPLIT,
                     positions: mx.array | None = None):
    """Arguments of pass 1 of the verify attention (also used by the CPU test harness);
    positions: ragged rows' key positions (`ops.verify_mask`), None: the last T of N."""
    B, Hq, T, D = q.shape
    Bk, Hkv, N, Dk = k.shape
    if (Bk, Dk) != (B, D) or tuple(v.shape) != tuple(k.shape) or Hq % Hkv or T > N:
        raise ValueError(f"verify_attention: q {q.shape}, k {k.shape}, v {v.shape} do not "
                         "match [B, Hq, T, D], [B, Hkv, N, D] with Hkv | Hq and T <= N")
    return _pass1(q, Hkv, N, [k, v], [], scale, window, sinks, split, positions)


def quant_attention_launch(q: mx.array, k: tuple, v: tuple, scale: float, group_size: int,
                           bits: int, window: int = 0, split: int = ATTN_SPLIT,
                           positions: mx.array | None = None):
    """Arguments of pass 1 over a quantized cache: k and v (packed, scales, biases) as
    mx.quantize leaves them for [B, Hkv, N, D] (also used by the CPU test harness)."""
    B, Hq, T, D = q.shape
    Hkv, N = k[0].shape[1:3]
    packed, groups = (B, Hkv, N, D * bits // 32), (B, Hkv, N, D // max(1, group_size))
    shapes = [tuple(a.shape) for a in (*k, *v)]
    if bits not in KV_BITS or group_size not in KV_GROUPS or D % group_size or Hq % Hkv or \
            T > N or shapes != [packed, groups, groups] * 2:
        raise ValueError(f"verify_attention_quant: q {q.shape}, {bits}-bit, group {group_size}, "
                         f"k and v parts {shapes}: expected {KV_BITS} bits, groups {KV_GROUPS} "
                         f"dividing D, parts {packed}, {groups}, {groups}, Hkv | Hq, T <= N")
    return _pass1(q, Hkv, N, [*k, *v], [("BITS", bits)], scale, window, None, split,
                  positions)


def _pass1(q: mx.array, Hkv: int, N: int, cache: list, template: list, scale: float,
           window: int, sinks: mx.array | None, split: int, positions: mx.array | None):
    """The launch dict both pass-1 kernels share: inputs q, the cache's arrays, kpos, sinks,
    params, scale; one threadgroup per SIMDS * RPS rows of a KV head and split."""
    B, Hq, T, D = q.shape
    if D not in ATTN_HEAD_DIMS or split % 32:
        raise ValueError(f"verify_attention: head dim {D} is not a multiple of 32 up to 256 "
                         f"(or split {split} not a multiple of 32)")
    S = -(-N // split)
    rows = (Hq // Hkv) * T
    has_sinks, ragged = sinks is not None, positions is not None
    if ragged and tuple(positions.shape) != (B, N):
        raise ValueError(f"verify_attention: positions {positions.shape} do not match the "
                         f"[B, N] = {(B, N)} key slots")
    kpos = mx.contiguous(positions.astype(mx.int32)) if ragged else mx.zeros((1,), mx.int32)
    params = mx.array([N, T, max(0, int(window)), int(has_sinks), split, int(ragged)],
                      mx.int32)
    return dict(
        inputs=[q, *cache, kpos, sinks if has_sinks else mx.zeros((1,), mx.float32), params,
                mx.array(scale, mx.float32)],
        template=[("T", q.dtype), ("D", D), ("SIMDS", ATTN_SIMDS), ("RPS", ATTN_RPS),
                  *template],
        grid=(32 * ATTN_SIMDS, -(-rows // (ATTN_SIMDS * ATTN_RPS)), B * Hkv * S),
        threadgroup=(32 * ATTN_SIMDS, 1, 1),
        output_shapes=[(B, Hq, T, S, D), (B, Hq, T, S, 2)],
        output_dtypes=[mx.float32, mx.float32])


def merge_launch(first: dict, o_part: mx.array, ml_part: mx.array):
    """Arguments of pass 2, from pass 1's arguments and outputs."""
    B, Hq, T, S, D = o_part.shape
    sinks, params = first["inputs"][-3:-1]
    dtype = first["template"][0][1]
    return dict(inputs=[o_part, ml_part, sinks, params], template=[("O", dtype)],
                grid=(D, B * Hq * T, 1), threadgroup=(min(D, 256), 1, 1),
                output_shapes=[(B, Hq, T, D)], output_dtypes=[dtype])


def verify_attention_metal(q: mx.array, k: mx.array, v: mx.array, scale: float,
                           window: int = 0, sinks: mx.array | None = None,
                           positions: mx.array | None = None) -> mx.array:
    """`ops.verify_attention_ops` in two launches: q [B, Hq, T, D] (the last T positions),
    k, v [B, Hkv, N, D], window 0 (none) or the keys a row sees, sinks [Hq] or None,
    positions [B, N] (ragged rows: each key slot's position, -1 a hole) or None
    -> [B, Hq, T, D]. Row-invariant: a row's bits do not depend on T."""
    first = attention_launch(q, k, v, scale, window, sinks, positions=positions)
    pass1, pass2 = verify_attention_kernels()
    o_part, ml_part = pass1(**first)
    return pass2(**merge_launch(first, o_part, ml_part))[0]


def verify_attention_quant_metal(q: mx.array, k: tuple, v: tuple, scale: float,
                                 group_size: int = 64, bits: int = 8, window: int = 0,
                                 positions: mx.array | None = None) -> mx.array:
    """`ops.verify_attention_quant_ops` in two launches: q [B, Hq, T, D], k and v mlx-lm's
    QuantizedKVCache parts (packed, scales, biases) of [B, Hkv, N, D] keys and values, each
    tile dequantized once for all rows, positions as for the float one -> [B, Hq, T, D].
    Row-invariant like the float one."""
    first = quant_attention_launch(q, k, v, scale, group_size, bits, window,
                                   positions=positions)
    o_part, ml_part = verify_attention_quant_kernel()(**first)
    return verify_attention_kernels()[1](**merge_launch(first, o_part, ml_part))[0]


def qmm_launch(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
               bits: int):
    """Arguments of the small-M quantized matmul (also used by the CPU test harness)."""
    *lead, K = x.shape
    M = 1
    for n in lead:
        M *= n
    N = w.shape[0]
    if bits not in QMM_BITS or M > QMM_MAX_ROWS or K % group_size or \
            tuple(w.shape) != (N, K * bits // 32) or tuple(scales.shape) != (N, K // group_size) \
            or tuple(biases.shape) != tuple(scales.shape) or group_size % 8:
        raise ValueError(f"small_m_qmm: x {x.shape}, w {w.shape}, scales {scales.shape}, "
                         f"{bits}-bit, group {group_size}: expected <= {QMM_MAX_ROWS} rows, "
                         f"4 or 8 bits and MLX's packing")
    dtype = (mx.zeros((), x.dtype) + mx.zeros((), scales.dtype)).dtype
    return dict(inputs=[x.reshape(M, K), w, scales, biases],
                template=[("T", dtype), ("BITS", bits), ("SIMDS", QMM_SIMDS)],
                grid=(32 * QMM_SIMDS, -(-N // (4 * QMM_SIMDS)), 1),
                threadgroup=(32 * QMM_SIMDS, 1, 1),
                output_shapes=[(M, N)], output_dtypes=[dtype])


def small_m_qmm_metal(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
                      group_size: int = 64, bits: int = 4) -> mx.array:
    """`mx.quantized_matmul(x, w, scales, biases, transpose=True, ...)` for x [..., K] of at
    most 16 rows, each weight group read once for all rows; row-invariant."""
    y = small_m_qmm_kernel()(**qmm_launch(x, w, scales, biases, group_size, bits))[0]
    return y.reshape(*x.shape[:-1], w.shape[0])
