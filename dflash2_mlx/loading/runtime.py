"""Platform defaults: the weight dtype and precision per backend (the BLAS is `blas.py`).

This module must not import mlx at import time.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import settings


def on_metal() -> bool:
    """True when MLX will run on the GPU through Metal."""
    import mlx.core as mx

    return mx.metal.is_available() and mx.default_device() == mx.gpu


def parse_dtype(name: str | None):
    """'float32' | 'float16' | 'bfloat16' | None -> mx.Dtype | None."""
    import mlx.core as mx

    if name is None:
        return None
    table = {"float32": mx.float32, "fp32": mx.float32, "float16": mx.float16,
             "fp16": mx.float16, "bfloat16": mx.bfloat16, "bf16": mx.bfloat16}
    if isinstance(name, mx.Dtype):
        return name
    if name not in table:
        raise ValueError(f"dtype must be one of float32, float16, bfloat16; got {name!r}")
    return table[name]


@dataclass(frozen=True)
class Precision:
    """How weights are held. dtype names a float dtype; None keeps the checkpoint's own."""

    backend: str                 # "metal" | "cpu"
    dtype: str | None            # target float weights
    keep_quantized: bool         # quantized target layers stay quantized (else dequantized)
    draft_dtype: str | None      # drafter float weights
    draft_bits: int | None       # 4 | 8; None = unquantized
    draft_group_size: int


def resolve_precision(dtype: str | None = None, draft_bits: int | None = None,
                      draft_group_size: int | None = None, draft_dtype: str | None = None, *,
                      metal: bool | None = None) -> Precision:
    """The one place where weight precision defaults are decided (used by `load` and the CLI).

    Metal: weights as stored (quantized targets stay quantized), drafter 4-bit, group size 64.
    CPU: float32 target and drafter, quantized targets dequantized, drafter unquantized: fp32
    matmuls run through BLAS, MLX's quantized matmuls do not (~15x slower here).
    `dtype` and `draft_bits` (4, 8; 16 = unquantized) override either default; `draft_dtype`
    defaults to `dtype`.
    """
    metal = on_metal() if metal is None else metal
    dtype, draft_dtype = settings.dtype(dtype), settings.dtype(draft_dtype, "draft_dtype")
    draft_bits = settings.draft_bits(draft_bits)
    draft_group_size = settings.draft_group_size(draft_group_size)
    if dtype is None and not metal:
        dtype = "float32"
    if draft_bits is None:
        draft_bits = 4 if metal else 16
    return Precision(backend="metal" if metal else "cpu", dtype=dtype, keep_quantized=metal,
                     draft_dtype=draft_dtype or dtype,
                     draft_bits=None if draft_bits == 16 else draft_bits,
                     draft_group_size=draft_group_size or 64)
