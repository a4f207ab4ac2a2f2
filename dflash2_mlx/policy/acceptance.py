"""Predicted acceptance of each draft position, once the draft exists: what the planner cuts a
verify by (`Planner.cut`), and how good each prediction is (`calibration`).

A prediction is a_k = P(draft k accepted | drafts < k accepted), k = 1..w-1, from:
- a drafter with a confidence head (DSpark): its head;
- a drafter without one: `SurenessModel`, a logistic regression on what the block's own
  distribution says at each position (its top log-probability, the margin over the second, the
  position), fitted to the acceptance observed while decoding;
- the lookup: the policy's per-position estimate for its match length (`AdaptiveWidth.alphas`:
  how the continuations of matches that long fared), or under a fixed width, which has no such
  estimates, `MatchModel`: the same counts, kept over every lookup row verified.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..decode.stats import DRAFTER

MARGIN_CAP = 8.0           # nats: a margin past it says nothing more


class SurenessModel:
    """a_k = sigmoid(b_k + w_lp * top log-probability + w_m * margin) for draft position k
    (`model.drafter.sureness`), fitted online by AdaGrad on the log-loss of each tried
    position; starts from a prior that trusts sure positions (a draft at probability 1 is
    accepted ~88% of the time, at 1/e ~60%). Shared by the sequences of one pipeline."""

    def __init__(self, positions: int, lr: float = 0.1, l2: float = 1e-3):
        self.w = np.concatenate([np.full(positions, 2.0), [1.0, 0.15]])
        self.g2 = np.full(positions + 2, 1e-2)
        self.positions, self.lr, self.l2 = positions, lr, l2
        self.seen = 0
        self.loss = 0.0                  # decayed mean log-loss of its predictions, as tried
        self.brier = 0.0

    def _x(self, sure: np.ndarray) -> np.ndarray:
        """[P, 2] sureness -> [P, positions + 2] design rows."""
        P = len(sure)
        x = np.zeros((P, self.positions + 2))
        x[np.arange(P), np.minimum(np.arange(P), self.positions - 1)] = 1.0
        x[:, -2] = sure[:, 0]
        x[:, -1] = np.minimum(sure[:, 1], MARGIN_CAP)
        return x

    def predict(self, sure: np.ndarray) -> np.ndarray:
        """[P, 2] -> a_1..a_P."""
        return 1.0 / (1.0 + np.exp(-(self._x(sure) @ self.w)))

    def learn(self, sure: np.ndarray, width: int, accepted: int) -> None:
        """A verify of `width` rows accepted `accepted` drafts: positions 1..min(accepted + 1,
        width - 1) were tried (the first rejected one fails)."""
        tried = min(accepted + 1, width - 1, len(sure))
        if tried < 1:
            return
        x = self._x(sure[:tried])
        y = (np.arange(1, tried + 1) <= accepted).astype(float)
        p = 1.0 / (1.0 + np.exp(-(x @ self.w)))
        eps = 1e-6
        loss = float(-np.mean(y * np.log(p + eps) + (1 - y) * np.log(1 - p + eps)))
        decay = min(self.seen, 199) / (min(self.seen, 199) + 1)
        self.loss = decay * self.loss + (1 - decay) * loss
        self.brier = decay * self.brier + (1 - decay) * float(np.mean((p - y) ** 2))
        self.seen += 1
        grad = x.T @ (p - y) + self.l2 * self.w
        self.g2 += grad**2
        self.w -= self.lr * grad / np.sqrt(self.g2)


class MatchModel:
    """a_k of a lookup draft for its match length: hits / tries of position k over the lookup
    rows verified with a match in the same length bucket (`BUCKETS`), each position's prior
    the estimate before it (position 1's: `prior`) at `prior_tries` tries. Shared by the
    sequences of one pipeline."""

    BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16)        # a bucket's shortest match

    def __init__(self, positions: int, prior: float = 0.5, prior_tries: float = 2.0):
        self.hits = np.zeros((len(self.BUCKETS), positions))
        self.tries = np.zeros((len(self.BUCKETS), positions))
        self.prior, self.prior_tries = prior, prior_tries

    def _bucket(self, match: int) -> int:
        return max(0, int(np.searchsorted(self.BUCKETS, match, side="right")) - 1)

    def predict(self, match: int, n: int) -> np.ndarray:
        """a_1..a_n of a draft copied after a match of `match` tokens."""
        b, out, a = self._bucket(match), [], self.prior
        for k in range(n):
            h, t = (self.hits[b, k], self.tries[b, k]) if k < self.hits.shape[1] else (0, 0)
            a = (h + a * self.prior_tries) / (t + self.prior_tries)
            out.append(a)
        return np.asarray(out)

    def learn(self, match: int, width: int, accepted: int) -> None:
        """A lookup row of `width` verified after a match of `match` tokens kept `accepted`
        drafts: positions 1..accepted hit, the one after (if drafted) missed."""
        b, tried = self._bucket(match), min(accepted + 1, width - 1, self.hits.shape[1])
        self.tries[b, :tried] += 1
        self.hits[b, :min(accepted, tried)] += 1


def predicted(source: str, width: int, sure: np.ndarray | None, confidence: np.ndarray | None,
              model: SurenessModel | None, alphas: Callable[[], list[float]]) -> np.ndarray:
    """a_1..a_{width-1} of one draft: the confidence head where there is one, else the
    sureness model, else (the lookup, or no features) the policy's own estimates (`alphas()`,
    asked only then)."""
    n = width - 1
    if source == DRAFTER and confidence is not None:
        return np.clip(np.asarray(confidence[:n], dtype=float), 0.0, 1.0)
    if source == DRAFTER and sure is not None and model is not None:
        return model.predict(np.asarray(sure[:n], dtype=float))
    a = list(alphas()[:n])
    a += [a[-1] if a else 0.5] * (n - len(a))
    return np.asarray(a, dtype=float)


def expected_tokens(a: np.ndarray) -> np.ndarray:
    """E(w) for w = 1..len(a)+1: 1 + sum_{k<w} prod_{j<=k} a_j (the bonus token counted)."""
    return np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(a))])


def calibration(records: list[tuple[int, float, bool]], bins: int = 10) -> dict:
    """DeepSpec's evaluator's figures of predicted prefix acceptance: records (position k,
    predicted P(drafts 1..k all accepted), whether they were) -> expected calibration error
    (equal-width bins, weighted by count), AUC (the probability a random accepted prefix is
    ranked above a random rejected one, ties half), both over all records and per position."""
    def figures(rs):
        if not rs:
            return {"n": 0, "ece": None, "auc": None, "mean_predicted": None,
                    "mean_observed": None}
        p = np.array([r[1] for r in rs])
        y = np.array([r[2] for r in rs], dtype=float)
        idx = np.minimum((p * bins).astype(int), bins - 1)
        ece = sum(abs(p[idx == b].mean() - y[idx == b].mean()) * (idx == b).sum()
                  for b in range(bins) if (idx == b).any()) / len(p)
        return {"n": len(rs), "ece": float(ece), "auc": _auc(p, y),
                "mean_predicted": float(p.mean()), "mean_observed": float(y.mean())}

    out = figures(records)
    out["positions"] = {k: figures([r for r in records if r[0] == k])
                        for k in sorted({r[0] for r in records})}
    return out


def _auc(p: np.ndarray, y: np.ndarray) -> float | None:
    pos, neg = p[y == 1], p[y == 0]
    if not len(pos) or not len(neg):
        return None
    order = np.argsort(np.concatenate([pos, neg]), kind="mergesort")
    ranks = np.empty(len(order))
    values = np.concatenate([pos, neg])[order]
    i = 0
    while i < len(values):                     # average ranks over ties
        j = i
        while j + 1 < len(values) and values[j + 1] == values[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2)
                 / (len(pos) * len(neg)))
