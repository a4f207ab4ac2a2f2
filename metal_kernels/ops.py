"""The MLX-ops references of the two DFlash 2 kernels (shapes in the docstrings): the contracts
the Metal kernels (`metal.py`) are tested against, and the path that runs without Metal."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import quantized_scaled_dot_product_attention


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


# --------------------------------------------------------------------------- verify kernels

def verify_mask(T: int, N: int, window: int = 0, positions: mx.array | None = None) -> mx.array:
    """[T, N] bool: query row t sits at position N - T + t and sees the keys up to it (causal
    inside the verified block), only the last `window` of them when window > 0.

    Ragged rows (the batch engine's caches), positions [B, N] int: the position of each key
    slot of each batch row, -1 a hole -> [B, 1, T, N]: query row t sits in slot N - T + t, at
    position P = positions[b, N - T + t], and sees the slots up to its own holding a position
    p >= 0 with p <= P (and P - p < window): `RaggedKVCache.make_mask`'s mask."""
    if positions is None:
        pos = mx.arange(N - T, N)[:, None]
        keys = mx.arange(N)[None, :]
        seen = keys <= pos
        return seen & (keys > pos - window) if window > 0 else seen
    kp = positions.astype(mx.int32)[:, None, :]                     # [B, 1, N]
    qp = positions.astype(mx.int32)[:, N - T:, None]                # [B, T, 1]
    slots = mx.arange(N)[None, None, :] <= mx.arange(N - T, N)[None, :, None]
    seen = slots & (kp >= 0) & (kp <= qp)
    if window > 0:
        seen = seen & (qp - kp < window)
    return seen[:, None]


def verify_attention_ops(q: mx.array, k: mx.array, v: mx.array, scale: float, window: int = 0,
                         sinks: mx.array | None = None,
                         positions: mx.array | None = None) -> mx.array:
    """The stock twin of `metal.verify_attention_metal`: q [B, Hq, T, D] (the last T positions),
    k, v [B, Hkv, N, D], window 0 or the keys a row sees, sinks [Hq] or None, positions
    [B, N] (ragged rows, `verify_mask`) or None -> [B, Hq, T, D]."""
    mask = verify_mask(q.shape[2], k.shape[2], window, positions)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)


def verify_attention_quant_ops(q: mx.array, k: tuple, v: tuple, scale: float,
                               group_size: int = 64, bits: int = 8, window: int = 0,
                               positions: mx.array | None = None) -> mx.array:
    """The stock twin of `metal.verify_attention_quant_metal`: mlx-lm's quantized attention
    (what a layer with a QuantizedKVCache runs) with the verify mask. q [B, Hq, T, D], k and v
    (packed, scales, biases) of [B, Hkv, N, D], positions as for the float twin
    -> [B, Hq, T, D]."""
    mask = verify_mask(q.shape[2], k[0].shape[2], window, positions)
    # q[...]: a new array, since mlx-lm scales its queries in place (`queries *= scale`)
    return quantized_scaled_dot_product_attention(q[...], k, v, scale, mask, group_size, bits)


def small_m_qmm_ops(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
                    group_size: int = 64, bits: int = 4) -> mx.array:
    """The stock twin of `metal.small_m_qmm_metal`: x [..., K] @ dequantize(w).T."""
    return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size,
                               bits=bits)
