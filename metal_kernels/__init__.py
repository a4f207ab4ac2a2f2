"""The two DFlash 2 kernels behind one interface: short convolution and candidate path walk.

Each kernel has an MLX-ops reference (`ops.py`, shapes in the docstrings) and, on Apple GPUs, a
custom Metal kernel built from the `.metal` sources beside it (`metal.py`); this folder,
`metal_kernels/`, is installed as `dflash2_mlx.model.kernels`. `short_conv` and
`path_walk` dispatch on a `KernelPath` chosen once (at load time), never from the environment
in the hot path.
"""

from __future__ import annotations

import os
from typing import Literal

import mlx.core as mx

from .metal import path_walk_metal, short_conv_metal
from .ops import pair_lattice, path_walk_ops, short_conv_ops

KernelPath = Literal["metal", "ops"]
KERNEL_ENV = "DFLASH2_KERNELS"  # "metal" | "ops" | unset (auto)


def metal_usable() -> bool:
    return mx.metal.is_available() and mx.default_device() == mx.gpu


def resolve_kernel_path(prefer: str | None = None) -> KernelPath:
    """Pick the kernel path: `prefer` ("metal" | "ops" | "auto" | None), else $DFLASH2_KERNELS.

    Forcing "metal" where Metal cannot run raises a clear error.
    """
    choice = prefer if prefer not in (None, "auto") else os.environ.get(KERNEL_ENV, "auto")
    if choice not in ("metal", "ops", "auto"):
        source = "kernels=" if prefer not in (None, "auto") else f"${KERNEL_ENV}="
        raise ValueError(f"{source}{choice!r}: expected 'metal', 'ops' or 'auto'")
    if choice == "metal" and not metal_usable():
        raise RuntimeError(
            "The Metal kernels were requested but Metal is not available here "
            f"(mx.metal.is_available()={mx.metal.is_available()}, default device "
            f"{mx.default_device()}); use kernels='ops' or unset ${KERNEL_ENV}.")
    if choice == "auto":
        return "metal" if metal_usable() else "ops"
    return choice


_short_conv_compiled = mx.compile(short_conv_ops)


def short_conv(y, dyn, base, residual=None, *, path: KernelPath = "ops"):
    """Dispatch: see `ops.short_conv_ops` for the contract."""
    if path == "metal":
        return short_conv_metal(y, dyn, base, residual)
    return _short_conv_compiled(y, dyn, base, residual)


@mx.compile
def _walk_greedy(cand, unary, g, pred_rows, succ_rows, anchor_pred):
    return path_walk_ops(cand, unary, g, pred_rows, succ_rows, anchor_pred)[0]


@mx.compile
def _walk_sample(cand, unary, g, pred_rows, succ_rows, anchor_pred, temperature, uniforms):
    return path_walk_ops(cand, unary, g, pred_rows, succ_rows, anchor_pred, temperature, uniforms)


def path_walk(cand, unary, g, pred_rows, succ_rows, anchor_pred, temperature: float = 0.0,
              uniforms=None, *, path: KernelPath = "ops"):
    """Dispatch: see `ops.path_walk_ops` for the contract."""
    if temperature > 0 and uniforms is None:
        raise ValueError("path_walk: sampling (temperature > 0) needs uniforms [B, L]")
    if path == "metal":
        return path_walk_metal(cand, unary, g, pred_rows, succ_rows, anchor_pred, temperature,
                               uniforms)
    if temperature <= 0:
        return _walk_greedy(cand, unary, g, pred_rows, succ_rows, anchor_pred), None
    return _walk_sample(cand, unary, g, pred_rows, succ_rows, anchor_pred,
                        mx.array(temperature, mx.float32), uniforms)


__all__ = ["KernelPath", "KERNEL_ENV", "metal_usable", "resolve_kernel_path", "short_conv",
           "path_walk", "short_conv_ops", "path_walk_ops", "pair_lattice"]
