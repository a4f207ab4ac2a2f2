"""DSpark's two heads beside the DFlash backbone: the Markov head (a low-rank bigram bias on
each block position's logits) and the confidence head (each position's probability of being
accepted). `Drafter` makes them where its config or tensors have them."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class MarkovHead(nn.Module):
    """DSpark's bigram bias: logits_i += markov_w2(markov_w1[token before position i]); the
    token a target id, the bias over the head's `out` rows (a draft vocabulary's, if reduced)."""

    def __init__(self, vocab: int, rank: int, out: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, out, bias=False)

    def __call__(self, prev: mx.array) -> mx.array:
        """prev [...] token ids -> the bias [..., V]."""
        return self.markov_w2(self.markov_w1(prev))


class ConfidenceHead(nn.Module):
    """DSpark's acceptance predictor: sigmoid(proj([h_i, markov_w1[prev_i]])) per position."""

    def __init__(self, features: int):
        super().__init__()
        self.proj = nn.Linear(features, 1)

    def __call__(self, features: mx.array) -> mx.array:
        return mx.sigmoid(self.proj(features)[..., 0])
