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
KERNEL_ENV = "DFLASH2_KERNELS"  # "auto" | "stock" | "metal" (settings.kernels); unset: auto


def metal_usable() -> bool:
    return mx.metal.is_available() and mx.default_device() == mx.gpu


def kernel_setting(prefer: str | None = None) -> str:
    """The `kernels` setting in effect: `prefer` unless None or "auto", else $DFLASH2_KERNELS,
    else "auto" -> "auto" | "stock" | "metal" (validated by `settings.kernels`)."""
    from ...settings import kernels as check_kernels

    given = prefer not in (None, "auto")
    return check_kernels(prefer if given else os.environ.get(KERNEL_ENV) or "auto",
                         "kernels" if given else f"${KERNEL_ENV}")


def resolve_kernel_path(prefer: str | None = None) -> KernelPath:
    """The drafter's kernel path from the `kernels` setting (`settings.kernels`: "auto",
    "stock" or its older name "ops", "metal", or None), else $DFLASH2_KERNELS, else auto.

    Forcing "metal" where Metal cannot run raises a clear error.
    """
    choice = kernel_setting(prefer)
    if choice == "metal" and not metal_usable():
        raise RuntimeError(
            "The Metal kernels were requested but Metal is not available here "
            f"(mx.metal.is_available()={mx.metal.is_available()}, default device "
            f"{mx.default_device()}); use kernels='stock' or unset ${KERNEL_ENV}.")
    if choice == "auto":
        return "metal" if metal_usable() else "ops"
    return "metal" if choice == "metal" else "ops"


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


__all__ = ["KernelPath", "KERNEL_ENV", "metal_usable", "kernel_setting", "resolve_kernel_path",
           "short_conv", "path_walk", "short_conv_ops", "path_walk_ops", "pair_lattice"]
