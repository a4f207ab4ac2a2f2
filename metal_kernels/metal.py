"""The Metal kernels of `kernels.short_conv` and `kernels.path_walk` (Apple GPUs only).

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

_IO = {  # input names, output names
    "short_conv": (("y", "dyn", "base", "residual"), ("out",)),
    "path_walk": (("cand", "first", "lattice", "temperature", "uniforms"), ("ids", "q")),
}


@functools.cache
def kernel_source(name: str) -> tuple[str, str]:
    """(header, body) of `metal_kernels/<name>.metal`, split at BODY_MARKER."""
    text = resources.files(__package__).joinpath(f"{name}.metal").read_text()
    header, marker, body = text.partition(BODY_MARKER)
    if not marker:
        raise RuntimeError(f"metal_kernels/{name}.metal has no {BODY_MARKER!r} line")
    return header, body


def kernel_spec(name: str) -> dict:
    """The `mx.fast.metal_kernel` arguments of kernel `name` ("short_conv" | "path_walk"); the
    CPU test harness builds its stand-in from the same dict."""
    header, body = kernel_source(name)
    inputs, outputs = _IO[name]
    return dict(name=f"dflash2_{name}", input_names=list(inputs), output_names=list(outputs),
                source=body, header=header, ensure_row_contiguous=False)


def _build(name: str):
    if not mx.metal.is_available():
        raise RuntimeError(f"The {name} Metal kernel needs Metal (mx.metal.is_available() is "
                           "False here); use the MLX-ops path (kernels='ops').")
    return mx.fast.metal_kernel(**kernel_spec(name))


@functools.cache
def short_conv_kernel():
    return _build("short_conv")


@functools.cache
def path_walk_kernel():
    return _build("path_walk")


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
