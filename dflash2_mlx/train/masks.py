"""Which keys each training block row may see, and how much each row's loss weighs.

Training packs every block of a sequence into one forward: the keys of a block row are the
sequence's context rows followed by its own block's rows. A block anchored at position `a`
(rows at positions a..a+B-1) sees the target features of positions < a only, its own rows
bidirectionally (or causally when the drafter is causal), and nothing of other blocks; the
block-block part is computed per block, so "other blocks" never appear as keys at all.
"""

from __future__ import annotations

import numpy as np


def context_mask(anchors: np.ndarray, block_size: int, n_ctx: int,
                 window: int | None = None) -> np.ndarray:
    """anchors [..., A] (positions; < 0 for padding) -> bool [..., A * B, n_ctx].

    Row j of the block at anchor a sits at position a + j and sees context position s iff
    s < a (and a + j - s < window for a sliding-window layer). Padding anchors see nothing.
    """
    anchors = np.asarray(anchors)
    pos = anchors[..., :, None] + np.arange(block_size)                 # [..., A, B]
    s = np.arange(n_ctx)
    visible = s < anchors[..., :, None, None]                           # [..., A, B|1, S]
    visible = np.broadcast_to(visible, pos.shape + (n_ctx,))
    if window is not None:
        visible = visible & (pos[..., None] - s < window)
    return visible.reshape(*anchors.shape[:-1], -1, n_ctx)


def block_mask(block_size: int, causal: bool = False) -> np.ndarray:
    """bool [B, B]: row i of a block sees row j of the same block (all, or j <= i if causal)."""
    if causal:
        return np.tril(np.ones((block_size, block_size), bool))
    return np.ones((block_size, block_size), bool)


def dense_mask(anchors: np.ndarray, block_size: int, n_ctx: int, causal: bool = False,
               window: int | None = None) -> np.ndarray:
    """The full mask of one packed sequence, for tests and documentation:
    anchors [A] -> bool [A * B, n_ctx + A * B] over keys [context rows ; all blocks' rows]."""
    A, B = len(anchors), block_size
    ctx = context_mask(np.asarray(anchors), B, n_ctx, window)
    blocks = np.zeros((A * B, A * B), bool)
    for i in range(A):
        blocks[i * B:(i + 1) * B, i * B:(i + 1) * B] = block_mask(B, causal)
    return np.concatenate([ctx, blocks], axis=1)


def position_weights(block_size: int, gamma: float) -> np.ndarray:
    """[B-1]: the loss weight of block rows k = 1..B-1, exp(-(k-1)/gamma) (row 0, the anchor,
    has no loss)."""
    k = np.arange(1, block_size)
    return np.exp(-(k - 1) / gamma).astype(np.float32)


def default_gamma(block_size: int) -> float:
    """The published choice: ~7 for blocks of 16, ~4 for blocks of 8 (linear in between)."""
    return max(1.0, 4.0 + (block_size - 8) * 3.0 / 8.0)
