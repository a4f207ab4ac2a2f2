"""Offline and real evaluation of a drafter on stored target responses (e.g. HumanEval's).

Offline (teacher forcing, exact for greedy): for every response anchor a of every sequence the
drafter drafts the block from the true context, with the FULL vocabulary through the target's
head. With greedy verification the accepted length is the number of leading rows whose draft
equals the target's token x_{a+k}; with the selector, the walk picks row k given the previous
pick, which equals the true token as long as everything before it was accepted, so the
teacher-forced pick with the TRUE predecessor gives the exact accepted length too.
tau = 1 + mean accepted (per sequence, then averaged over sequences, as the DFlash papers
report it).

Recall@1 / Recall@16 at block row k: the target's token is the drafter's first choice / among
its top 16 (the candidates the DFlash 2 selector walks), the block drafted from the true context.

T = 1 (an estimate): row k is accepted with probability alpha_k = sum_x min(p_k(x), q_k(x))
(p: the target's stored top-16 distribution, so alpha is slightly underestimated; q: the
drafter's softmax, or the selector's distribution over its candidates given the data's
predecessor); expected accepted drafts = sum_k prod_{j<=k} alpha_j. Real sampling runs through
`real_eval` confirm it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np

from .. import log
from ..model.drafter import Drafter
from ..model.topk import top_k_indices
from .config import TrainConfig
from .data import FeatureStore
from .trainer import Batcher, head_matrix, windows_of
from .packed import packed_hidden
from .losses import selector_scores

ROW_CHUNK = 512


def _leading(ok: np.ndarray) -> np.ndarray:
    """ok [A, K] bool -> number of leading True per row."""
    return np.cumprod(ok, axis=1).sum(axis=1)


def _expected_accepted(alpha: np.ndarray) -> np.ndarray:
    """alpha [A, K] acceptance probabilities (0 where no row) -> expected accepted drafts."""
    return np.cumprod(alpha, axis=1).sum(axis=1)


@dataclass
class SeqResult:
    accepted: np.ndarray         # [A] greedy, drafter's argmax
    top1: np.ndarray             # [A, K] bool, NaN-free; valid marks rows with a label
    top16: np.ndarray
    valid: np.ndarray
    t1_alpha: np.ndarray         # [A, K]
    sel_accepted: np.ndarray | None = None
    sel_top1: np.ndarray | None = None
    sel_alpha: np.ndarray | None = None
    # with keep_hidden: (grid positions anchor * K + k - 1 of the rows, their hidden states)
    hidden: tuple[np.ndarray, np.ndarray] | None = None


def _selector_rows(sel, logits: mx.array, cand: mx.array, hidden: mx.array,
                   prev_ids: mx.array, teacher_ids: mx.array, p: mx.array, lab: mx.array,
                   temperature: float) -> tuple[mx.array, mx.array]:
    """For a chunk of rows: whether the selector's pick among the drafter's top-k is the
    label, and its acceptance against the teacher's distribution `p` (over `teacher_ids`)."""
    K16 = sel.top_k
    c = cand if K16 == 16 else top_k_indices(logits, K16)
    u = mx.take_along_axis(logits, c, axis=-1)
    sc = selector_scores(u, sel.hidden_projection(hidden), sel.predecessor_codebook(prev_ids),
                         sel.successor_codebook(c))
    pick = mx.take_along_axis(c, mx.argmax(sc, -1)[:, None], -1)[:, 0]
    qs = mx.softmax(sc / temperature, axis=-1)                      # [r, K16]
    match = c[:, :, None] == teacher_ids[:, None, :]                # [r, K16, 16]
    p_at = (match * p[:, None, :]).sum(-1)
    return pick == lab, mx.minimum(p_at, qs).sum(-1)


def eval_sequence(drafter: Drafter, batcher: Batcher, head_w: mx.array, i: int,
                  temperature: float = 1.0, keep_hidden: bool = False) -> SeqResult:
    """Sequence i's figures (`SeqResult`); keep_hidden: also its rows' hidden states (float16),
    what a confidence head is trained on (`heads`)."""
    B = drafter.args.block_size
    K = B - 1
    batch = batcher.make(None, seqs=[i], all_anchors=True, windows=windows_of(drafter))
    h = packed_hidden(drafter, batch.x, batch.feats, batch.anchors, batch.ctx_visible,
                      batch.block_visible)
    H = h.shape[-1]
    A = h.shape[1]
    hr = h[:, :, 1:].reshape(-1, H)[batch.rows]
    rows = np.array(batch.rows)
    sel = drafter.candidate_selector if drafter.args.has_selector else None
    top1, top16, alpha, s_top1, s_alpha = [], [], [], [], []
    for s in range(0, hr.shape[0], ROW_CHUNK):
        part = slice(s, s + ROW_CHUNK)
        logits = drafter.logits(hr[part], lambda z: z @ head_w.T)
        lab = batch.label_ids[part]
        cand = top_k_indices(logits, 16)
        vals = mx.take_along_axis(logits, cand, axis=-1)
        first = mx.take_along_axis(cand, mx.argmax(vals, -1)[:, None], -1)[:, 0]
        top1.append(first == lab)
        top16.append((cand == lab[:, None]).any(-1))
        p = mx.softmax(batch.teacher_lp[part], axis=-1) * \
            mx.exp(mx.logsumexp(batch.teacher_lp[part], axis=-1, keepdims=True))
        logq = logits / temperature
        logq = logq - mx.logsumexp(logq, axis=-1, keepdims=True)
        q = mx.exp(mx.take_along_axis(logq, batch.teacher_ids[part], axis=-1))
        alpha.append(mx.minimum(p, q).sum(-1))
        if sel is not None:
            hit, a = _selector_rows(sel, logits, cand, hr[part], batch.prev_ids[part],
                                    batch.teacher_ids[part], p, lab, temperature)
            s_top1.append(hit)
            s_alpha.append(a)
        mx.eval(top1[-1], top16[-1], alpha[-1], *(s_top1[-1:] + s_alpha[-1:]))

    def grid(parts, dtype):
        out = np.zeros(A * K, dtype)
        out[rows] = np.concatenate([np.array(x) for x in parts])
        return out.reshape(A, K)

    valid = np.zeros(A * K, bool)
    valid[rows] = True
    valid = valid.reshape(A, K)
    n_anchor = int((np.array(batch.anchors)[0] >= 0).sum())
    res = SeqResult(accepted=None, top1=grid(top1, bool)[:n_anchor],
                    top16=grid(top16, bool)[:n_anchor], valid=valid[:n_anchor],
                    t1_alpha=grid(alpha, np.float32)[:n_anchor])
    res.accepted = _leading(res.top1)
    if sel is not None:
        res.sel_top1 = grid(s_top1, bool)[:n_anchor]
        res.sel_alpha = grid(s_alpha, np.float32)[:n_anchor]
        res.sel_accepted = _leading(res.sel_top1)
    if keep_hidden:
        res.hidden = (rows, np.array(hr.astype(mx.float16)))
    return res


def offline_eval(drafter: Drafter, adapter, store: FeatureStore,
                 seqs: Sequence[int] | None = None, temperature: float = 1.0) -> dict:
    """Offline figures of `drafter` on the stored responses (see the module docstring).

    -> {"tau": greedy tau (the drafter's own decoding: the selector walk when it has one),
        "tau_argmax", "tau_selector", "tau_t1" (estimate), "recall1", "recall16" (per row k),
        "selector_recall1", "anchors", "sequences"}."""
    seqs = list(range(len(store))) if seqs is None else list(seqs)
    cfg = TrainConfig(soft_k=16)
    batcher = Batcher(store, seqs, drafter.args, cfg, None, adapter.embed)
    head_w = head_matrix(adapter)
    results = []
    for i in log.progress(batcher.seqs, "offline eval"):
        results.append(eval_sequence(drafter, batcher, head_w, i, temperature))
        mx.clear_cache()
    return summarize(results, drafter.args.has_selector)


def summarize(results: list[SeqResult], has_selector: bool) -> dict:
    def per_request(key):
        return float(np.mean([1 + getattr(r, key).mean() for r in results]))

    valid = np.concatenate([r.valid for r in results])
    top1 = np.concatenate([r.top1 for r in results])
    top16 = np.concatenate([r.top16 for r in results])

    def by_row(x):
        return [float(x[:, k][valid[:, k]].mean()) for k in range(x.shape[1])]

    out = {"sequences": len(results), "anchors": int(sum(len(r.accepted) for r in results)),
           "tau_argmax": per_request("accepted"),
           "tau_argmax_per_anchor": float(1 + np.concatenate([r.accepted for r in results]).mean()),
           "tau_t1_argmax": float(np.mean([1 + _expected_accepted(r.t1_alpha).mean()
                                           for r in results])),
           "recall1": by_row(top1), "recall16": by_row(top16)}
    out["tau"], out["tau_t1"] = out["tau_argmax"], out["tau_t1_argmax"]
    if has_selector:
        out["tau_selector"] = per_request("sel_accepted")
        out["tau_t1_selector"] = float(np.mean([1 + _expected_accepted(r.sel_alpha).mean()
                                                for r in results]))
        out["selector_recall1"] = by_row(np.concatenate([r.sel_top1 for r in results]))
        out["tau"], out["tau_t1"] = out["tau_selector"], out["tau_t1_selector"]
    return out


def real_eval(pipeline, prompts: Sequence[str], *, max_tokens: int = 256,
              temperature: float = 0.0, block_size: int | None = None, seed: int = 0,
              lookup: bool | None = None) -> dict:
    """Generate with `pipeline` (a `dflash2_mlx.Pipeline`) on each prompt; tau per request,
    then averaged (as the DFlash papers report it), per-position acceptance and decode speed.
    lookup: False for the drafter alone (None: the pipeline's default)."""
    taus, acc, tps, cycles, gen_tokens, secs = [], [], [], 0, 0, 0.0
    for j, prompt in enumerate(log.progress(prompts, "real eval")):
        t = time.perf_counter()
        g = pipeline.generate(prompt, max_tokens=max_tokens, temperature=temperature,
                              block_size=block_size, seed=seed + j, lookup=lookup)
        secs += time.perf_counter() - t
        taus.append(g.stats.tau)
        acc.append(g.stats.position_acceptance())
        tps.append(g.stats.decode_tps)
        cycles += g.stats.cycles
        gen_tokens += g.stats.generated_tokens
    width = max(len(a) for a in acc) if acc else 0
    seen = [[a[k] for a in acc if len(a) > k and a[k] is not None] for k in range(width)]
    pos = [float(np.mean(xs)) if xs else None for xs in seen]        # None: never tried
    return {"prompts": len(taus), "tau": float(np.mean(taus)), "position_acceptance": pos,
            "decode_tps": float(np.mean(tps)), "cycles": cycles, "tokens": gen_tokens,
            "seconds": secs, "temperature": temperature}
