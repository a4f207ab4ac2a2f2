"""Target distribution and acceptance: greedy prefix matching and exact rejection sampling.

The target's sampling distribution is mlx-lm's: top-p then top-k applied to the log-probabilities
(mlx-lm's own `apply_top_p` / `apply_top_k`), then softmax at temperature T. Speculative
sampling (Leviathan et al.; Chen et al., 2023) keeps that distribution exactly, whatever the
draft distribution q is, as long as q is the distribution the draft token was drawn from.

All functions work on device arrays so a cycle needs one host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p

from .. import settings  # the validators the CLI, the API and the settings file share


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        settings.temperature(self.temperature)
        settings.top_p(self.top_p)
        settings.top_k(self.top_k)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: mx.array) -> mx.array:
        """[..., V] logits -> [..., V] float32 probabilities of the filtered, tempered target."""
        logits = logits.astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        if 0 < self.top_k < logits.shape[-1]:
            logprobs = apply_top_k(logprobs, self.top_k)
        return mx.softmax(logprobs / self.temperature, axis=-1)

    def sample(self, logits: mx.array, key: mx.array | None = None) -> mx.array:
        """[..., V] -> [...] token ids (argmax when greedy)."""
        if self.greedy:
            return mx.argmax(logits, axis=-1)
        return mx.random.categorical(mx.log(self.probs(logits)), key=key)


def greedy_accept(drafts: mx.array, target_ids: mx.array) -> tuple[mx.array, mx.array]:
    """drafts [L-1], target_ids [L] (argmax of each verify row) -> (accepted a, bonus token).

    a = length of the longest prefix with drafts[i] == target_ids[i]; bonus = target_ids[a].
    """
    a = mx.sum(mx.cumprod((drafts == target_ids[:-1]).astype(mx.int32)))
    return a, target_ids[a]


def rejection_accept(drafts: mx.array, p: mx.array, q: mx.array | None,
                     key: mx.array) -> tuple[mx.array, mx.array]:
    """Speculative sampling of one block.

    drafts [L-1] drawn from q [L-1, V] (None: a point mass on each draft, as the lookup's);
    p [L, V] the target's distribution for each verify row -> (accepted a, bonus token).
    Draft i is accepted with probability min(1, p_i/q_i); at the first rejection the bonus is
    drawn from norm(max(p_a - q_a, 0)); if all are accepted, from p_{L-1}.
    """
    k_accept, k_bonus = mx.random.split(key)
    n = drafts.shape[0]
    rows = mx.arange(n)
    p_d = p[rows, drafts]
    u = mx.random.uniform(shape=(n,), key=k_accept)
    if q is None:
        a = mx.sum(mx.cumprod((u < p_d).astype(mx.int32)))
        # p_a less the point mass: p_a with the rejected draft's entry zeroed
        rejected = mx.concatenate([drafts, mx.array([p.shape[1]], drafts.dtype)])[a]
        residual = mx.where(mx.arange(p.shape[1]) == rejected, 0.0, p[a])
    else:
        a = mx.sum(mx.cumprod((u * q[rows, drafts] < p_d).astype(mx.int32)))
        q_next = mx.concatenate([q, mx.zeros((1, q.shape[1]), q.dtype)])[a]  # 0: all accepted
        residual = mx.maximum(p[a] - q_next, 0)
    total = residual.sum()
    # p_a == q_a would leave nothing, but then draft a is accepted with probability 1.
    residual = mx.where(total > 0, residual / mx.maximum(total, 1e-30), p[a])
    return a, mx.random.categorical(mx.log(residual), key=k_bonus)
