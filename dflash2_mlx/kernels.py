"""The two DFlash 2 kernels behind one interface: short convolution and candidate path walk.

Each kernel has an MLX-ops reference (`*_ops`, shapes in the docstring) and, on Apple GPUs, a
custom Metal kernel built from `metal_kernels/*.metal`. `short_conv` and `path_walk` dispatch
on a `KernelPath` chosen once (at load time), never from the environment in the hot path.
"""

from __future__ import annotations

import os
from typing import Literal

import mlx.core as mx

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


# --------------------------------------------------------------------------- short convolution

def short_conv_ops(y: mx.array, dyn: mx.array, base: mx.array,
                   residual: mx.array | None = None) -> mx.array:
    """One side of the two-tap dynamic convolution along the block rows.

    y [B, L, H], dyn [B, L, K, H/G], base [K, H], residual [B, L, H] or None -> [B, L, H]

    out[b, t, c] = sum_k (base[k, c] + dyn[b, t, k, c // G]) * y[b, t - k, c]   (rows < 0 read 0)
    plus `residual` when given (the fused residual add of the "after" side).
    """
    B, L, H = y.shape
    K, groups = base.shape[0], dyn.shape[-1]
    coef = base.reshape(K, groups, H // groups) + dyn[..., None]     # [B, L, K, groups, G]
    coef = coef.reshape(B, L, K, H).astype(y.dtype)
    out = coef[:, :, 0] * y
    for k in range(1, min(K, L)):
        shifted = mx.concatenate([mx.zeros((B, k, H), y.dtype), y[:, : L - k]], axis=1)
        out = out + coef[:, :, k] * shifted
    return out if residual is None else residual + out


_short_conv_compiled = mx.compile(short_conv_ops)


def short_conv(y, dyn, base, residual=None, *, path: KernelPath = "ops"):
    """Dispatch: see `short_conv_ops` for the contract."""
    if path == "metal":
        from .metal import short_conv_metal

        return short_conv_metal(y, dyn, base, residual)
    return _short_conv_compiled(y, dyn, base, residual)


# --------------------------------------------------------------------------- path walk

def pair_lattice(unary: mx.array, g: mx.array, pred_rows: mx.array, succ_rows: mx.array,
                 anchor_pred: mx.array) -> tuple[mx.array, mx.array]:
    """All pair scores of the walk, computed at once.

    unary [B, L, K], g [B, L, R], pred_rows/succ_rows [B, L, K, R] (codebook rows of each
    candidate), anchor_pred [B, R] (predecessor row of the anchor)
    -> first [B, K]: S_0(anchor, b);  lattice [B, L-1, K, K]: S_t(cand_{t-1}[a], cand_t[b]).
    """
    gq = g[:, :, None, :] * succ_rows                                  # [B, L, K, R]
    first = unary[:, 0] + (anchor_pred[:, None, :] * gq[:, 0]).sum(-1)
    lattice = pred_rows[:, :-1] @ gq[:, 1:].swapaxes(-1, -2) + unary[:, 1:, None, :]
    return first, lattice


def _pick(scores: mx.array, temperature, u: mx.array | None):
    """scores [B, K] -> (index [B], q [B, K] or None). Greedy (u is None): ties go to the
    first maximum. Sampling: q = softmax(scores / T), index by inverse CDF of the uniform u [B]."""
    if u is None:
        return mx.argmax(scores, axis=-1), None
    q = mx.softmax(scores.astype(mx.float32) / temperature, axis=-1)
    index = mx.sum(mx.cumsum(q, axis=-1) <= u[:, None], axis=-1)   # P(index = i) = q[i]
    return mx.minimum(index, q.shape[-1] - 1), q


def path_walk_ops(cand: mx.array, unary: mx.array, g: mx.array, pred_rows: mx.array,
                  succ_rows: mx.array, anchor_pred: mx.array, temperature: float = 0.0,
                  uniforms: mx.array | None = None):
    """Walk the top-K candidates of each row, choosing each token given its predecessor.

    S_t(a, b) = unary_t[b] + sum_r P[a, r] g_t[r] Q[b, r]; row 0's predecessor is the anchor.
    cand [B, L, K] int, unary [B, L, K], g [B, L, R], pred_rows/succ_rows [B, L, K, R] (the
    codebook rows P[cand], Q[cand]), anchor_pred [B, R] (P[anchor]),
    uniforms [B, L] in [0, 1) to sample at `temperature`, None for greedy
    -> ids [B, L] int32, q [B, L, K] float32 (None when greedy).
    """
    first, lattice = pair_lattice(unary, g, pred_rows, succ_rows, anchor_pred)
    index, q = _pick(first, temperature, None if uniforms is None else uniforms[:, 0])
    indices, qs = [index], [q]
    for t in range(1, cand.shape[1]):
        rows = mx.take_along_axis(lattice[:, t - 1], index[:, None, None], axis=1)[:, 0]
        index, q = _pick(rows, temperature, None if uniforms is None else uniforms[:, t])
        indices.append(index)
        qs.append(q)
    ids = mx.take_along_axis(cand, mx.stack(indices, axis=1)[..., None], axis=-1)[..., 0]
    return ids.astype(mx.int32), (None if uniforms is None else mx.stack(qs, axis=1))


@mx.compile
def _walk_greedy(cand, unary, g, pred_rows, succ_rows, anchor_pred):
    return path_walk_ops(cand, unary, g, pred_rows, succ_rows, anchor_pred)[0]


@mx.compile
def _walk_sample(cand, unary, g, pred_rows, succ_rows, anchor_pred, temperature, uniforms):
    return path_walk_ops(cand, unary, g, pred_rows, succ_rows, anchor_pred, temperature, uniforms)


def path_walk(cand, unary, g, pred_rows, succ_rows, anchor_pred, temperature: float = 0.0,
              uniforms=None, *, path: KernelPath = "ops"):
    """Dispatch: see `path_walk_ops` for the contract."""
    if temperature > 0 and uniforms is None:
        raise ValueError("path_walk: sampling (temperature > 0) needs uniforms [B, L]")
    if path == "metal":
        from .metal import path_walk_metal

        return path_walk_metal(cand, unary, g, pred_rows, succ_rows, anchor_pred, temperature,
                               uniforms)
    if temperature <= 0:
        return _walk_greedy(cand, unary, g, pred_rows, succ_rows, anchor_pred), None
    return _walk_sample(cand, unary, g, pred_rows, succ_rows, anchor_pred,
                        mx.array(temperature, mx.float32), uniforms)
