"""DFlash 2's candidate selector: the top-K candidates of each block position, scored in pairs
(a predecessor's and a successor's codebook rows, weighted by the position's hidden state), and
the path walk through them (`kernels.path_walk`: a Metal kernel or its MLX twin)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .config import DrafterArgs
from .kernels import KernelPath, path_walk
from .topk import top_k_indices


class CandidateSelector(nn.Module):
    """Scores candidate pairs: S_t(a, b) = U_t(b) + sum_r P[a, r] g_t[r] Q[b, r]."""

    def __init__(self, args: DrafterArgs):
        super().__init__()
        self.top_k = args.selector_top_k
        self.path: KernelPath = "ops"        # set for the whole drafter by `Drafter.kernels`
        self.hidden_projection = nn.Linear(args.hidden_size, args.selector_rank, bias=False)
        # Stored as `candidate_selector.{predecessor,successor}_codebook` in checkpoints.
        self.predecessor_codebook = nn.Embedding(args.vocab_size, args.selector_rank)
        self.successor_codebook = nn.Embedding(args.vocab_size, args.selector_rank)

    def candidates(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        """logits [B, L, V] -> top-K ids [B, L, K] and their logits (unary scores) [B, L, K]."""
        cand = top_k_indices(logits, self.top_k)
        return cand, mx.take_along_axis(logits, cand, axis=-1)

    def walk(self, h: mx.array, logits: mx.array, anchor: mx.array, temperature: float,
             uniforms: mx.array | None, vocab: mx.array | None = None):
        """h [B, L, H] proposal rows, logits [B, L, V'], anchor [B]; `vocab` [V'] maps logit
        columns to token ids when the logits cover a draft vocabulary only
        -> ids [B, L], cand [B, L, K] (token ids), q [B, L, K] (None when greedy)."""
        return self.walk_inputs(h, logits, anchor, vocab).walk(temperature, uniforms)

    def walk_inputs(self, h: mx.array, logits: mx.array, anchor: mx.array,
                    vocab: mx.array | None = None) -> "WalkInputs":
        """What the walk reads, for all B rows at once (see `walk`)."""
        cand, unary = self.candidates(logits)
        if vocab is not None:
            cand = vocab[cand]
        # Scores in float32: in 16-bit, pair scores of ~20 round to steps of 0.125 and ties
        # between candidates become common. The tensors are tiny ([L, K, R]).
        f32 = lambda x: x.astype(mx.float32)
        return WalkInputs(cand, f32(unary), f32(self.hidden_projection(h)),
                          f32(self.predecessor_codebook(cand)),
                          f32(self.successor_codebook(cand)),
                          f32(self.predecessor_codebook(anchor)), self.path)


@dataclass
class WalkInputs:
    """The selector walk's inputs (`kernels.path_walk`), rows of B sequences."""

    cand: mx.array
    unary: mx.array
    g: mx.array
    pred_rows: mx.array
    succ_rows: mx.array
    anchor_pred: mx.array
    path: KernelPath

    def rows(self, index: mx.array) -> "WalkInputs":
        """Those of the sequences at `index` [m]."""
        return WalkInputs(self.cand[index], self.unary[index], self.g[index],
                          self.pred_rows[index], self.succ_rows[index], self.anchor_pred[index],
                          self.path)

    def walk(self, temperature: float, uniforms: mx.array | None):
        """-> ids [B, L], cand [B, L, K] (token ids), q [B, L, K] (None when greedy)."""
        ids, q = path_walk(self.cand, self.unary, self.g, self.pred_rows, self.succ_rows,
                           self.anchor_pred, temperature, uniforms, path=self.path)
        return ids, self.cand, q
