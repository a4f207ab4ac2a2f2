"""Platform defaults: the weight dtype and precision per backend (the BLAS is `blas.py`).

This module must not import mlx at import time.
"""

from __future__ import annotations

from dataclasses import dataclass


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


DTYPES = ("float32", "float16", "bfloat16")
DRAFT_BITS = (4, 8, 16)             # 16 = unquantized
DRAFT_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class Precision:
    """How weights are held. dtype names a float dtype; None keeps the checkpoint's own."""

    backend: str                 # "metal" | "cpu"
    dtype: str | None            # target float weights
    keep_quantized: bool         # quantized target layers stay quantized (else dequantized)
    draft_dtype: str | None      # drafter float weights
    draft_bits: int | None       # 4 | 8; None = unquantized
    draft_group_size: int


def dtype_name(value, what: str = "dtype") -> str | None:
    """'float32' | 'fp32' | mx.float32 | ... -> 'float32' (None stays None)."""
    if value is None:
        return None
    name = str(value).rsplit(".", 1)[-1]          # mx.float32 prints as "mlx.core.float32"
    name = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"{what} must be one of {', '.join(DTYPES)}; got {value!r}")
    return name


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
    dtype, draft_dtype = dtype_name(dtype, "dtype"), dtype_name(draft_dtype, "draft_dtype")
    if draft_bits is not None and draft_bits not in DRAFT_BITS:
        raise ValueError(f"draft_bits must be 4, 8 or 16 (unquantized); got {draft_bits!r}")
    if draft_group_size is not None and draft_group_size not in DRAFT_GROUP_SIZES:
        raise ValueError(f"draft_group_size must be 32, 64 or 128; got {draft_group_size!r}")
    if dtype is None and not metal:
        dtype = "float32"
    if draft_bits is None:
        draft_bits = 4 if metal else 16
    return Precision(backend="metal" if metal else "cpu", dtype=dtype, keep_quantized=metal,
                     draft_dtype=draft_dtype or dtype,
                     draft_bits=None if draft_bits == 16 else draft_bits,
                     draft_group_size=draft_group_size or 64)
