"""Training losses: position-weighted block CE / distillation and the selector's candidate CE.

Every function takes flat rows: R predicted block rows (padding rows already dropped), each with
a weight w = exp(-(k-1)/gamma) of its block position k; losses are sum(w * row_loss) / sum(w).

The drafter's logits may be computed over a sub-vocabulary `C` (ids sorted ascending) instead
of the full one to save the head's cost; `labels` and teacher ids are then indices into C.
"""

from __future__ import annotations

import mlx.core as mx

from .host_exp import softmax_forward


@mx.custom_function
def log_normaliser(logits: mx.array) -> tuple[mx.array, mx.array]:
    """logits [R, V] -> (log Z [R], softmax [R, V]) with one `exp` of the logits for forward
    and backward together (`mx.logsumexp` would redo it in its gradient; on the CPU backend
    numpy's, see `host_exp`). log Z = max(logits) - log max(softmax): the largest probability is at
    least 1/V, so its log is exact where a label's might underflow. The softmax output is for
    the gradient only: it carries none of its own."""
    p = softmax_forward(logits)
    return logits.max(-1) - mx.log(p.max(-1)), p


@log_normaliser.vjp
def _log_normaliser_vjp(primals, cotangents, outputs):
    return (cotangents[0][:, None] * outputs[1],)


def weighted_mean(values: mx.array, weights: mx.array) -> mx.array:
    return (values * weights).sum() / mx.maximum(weights.sum(), 1e-9)


def block_loss(logits: mx.array, labels: mx.array, weights: mx.array,
               teacher_ids: mx.array | None = None, teacher_logp: mx.array | None = None,
               soft: float = 0.0) -> tuple[mx.array, mx.array]:
    """logits [R, V'] (drafter), labels [R] (the target's token), weights [R];
    teacher_ids/teacher_logp [R, k]: the target's top-k distribution (renormalised over k).

    -> (loss, per-row CE of the hard label [R]). loss = weighted mean of
    (1 - soft) * CE(label) + soft * CE(teacher top-k distribution).
    """
    logz, _ = log_normaliser(logits)
    ce = logz - mx.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
    row = ce
    if soft > 0 and teacher_ids is not None:
        p = mx.softmax(teacher_logp.astype(mx.float32), axis=-1)
        logq = mx.take_along_axis(logits, teacher_ids, axis=-1) - logz[:, None]
        row = (1 - soft) * ce - soft * (p * logq).sum(-1)
    return weighted_mean(row, weights), ce


def selector_scores(unary: mx.array, g: mx.array, prev_rows: mx.array,
                    cand_rows: mx.array) -> mx.array:
    """S(prev, b) = U(b) + sum_r P[prev, r] g[r] Q[b, r] for each row's K candidates.

    unary [R, K], g [R, Rk], prev_rows [R, Rk] (P[prev]), cand_rows [R, K, Rk] (Q[cand])
    -> [R, K]."""
    return unary + ((prev_rows * g)[:, None, :] * cand_rows).sum(-1)


def selector_loss(scores: mx.array, cand: mx.array, labels: mx.array,
                  weights: mx.array) -> tuple[mx.array, mx.array]:
    """Cross-entropy over the K candidate scores [R, K] given the true predecessor; rows whose
    true token (labels [R], same id space as cand [R, K]) is not a candidate are skipped.

    -> (loss, hit [R] bool: the true token is among the candidates)."""
    match = cand == labels[:, None]
    hit = match.any(-1)
    target = mx.argmax(match, axis=-1)
    ce = mx.logsumexp(scores, axis=-1) - mx.take_along_axis(scores, target[:, None], -1)[:, 0]
    w = weights * hit
    return weighted_mean(mx.where(hit, ce, 0.0), w), hit
