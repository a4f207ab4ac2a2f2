"""Widths chosen after drafting: how much of each drafted block to verify, from the predicted
acceptance of its positions (`acceptance`) and the calibrated price of each verify width.

Alone, a block of w rows keeps the prefix K <= w with the most expected tokens per second,
    E(K) / (D + verify(K)),   E(K) = 1 + sum_{k<K} prod_{j<=k} a_j,
D the drafter pass already paid (it counts whatever K is); K = 1 is a plain step. In a batch a
step costs what its widest row costs, so the step's width T is chosen jointly: T maximizes
    sum_i E_i(min(w_i, T)) / step_cost(n, T, D),
and each row verifies min(w_i, T) (rows narrower than T cost nothing more verified whole).
Only which rows are verified changes: greedy output stays the target's, and sampled output
stays exact because every prediction is read before a drafted token is drawn (`Drafted`).
"""

from __future__ import annotations

import numpy as np

from ..decode.stats import DRAFTER, PLAIN
from .acceptance import expected_tokens


def cut_alone(policy, source: str, width: int, a: np.ndarray, context: int | None) -> int:
    """One sequence's verify width K <= width (`AdaptiveWidth` prices)."""
    sunk = policy.cost.draft(width, context) if source == DRAFTER else 0.0
    E = expected_tokens(a[: width - 1])
    best, best_rate = 1, E[0] / (policy.cycle_cost(1, PLAIN, context) + sunk)
    for K in range(2, width + 1):
        rate = E[K - 1] / policy.cycle_cost(K, source, context)
        if rate > best_rate:
            best, best_rate = K, rate
    return best


def cut_batch(batch_policy, widths: list[int], a: list[np.ndarray | None], fixed: list[bool],
              slots: int | None, drafts: float) -> int:
    """The step's width T for rows of planned `widths` and predictions `a` (None: a plain
    row, one token); `fixed` rows keep their width (T >= each);
    `batch_policy.step_cost` prices the step after a drafter pass of `drafts` seconds."""
    n = len(widths)
    low = max([w for w, f in zip(widths, fixed) if f] + [1])
    E = [None if x is None else expected_tokens(x[: w - 1]) for x, w in zip(a, widths)]
    best, best_rate = None, -1.0
    for T in range(low, max(widths) + 1):
        tokens = sum(1.0 if e is None else e[(w if f else min(w, T)) - 1]
                     for e, w, f in zip(E, widths, fixed))
        rate = tokens / batch_policy.step_cost(n, T, slots, drafts)
        if rate > best_rate:
            best, best_rate = T, rate
    return best
