"""Training a confidence head on a trained drafter, its backbone frozen (`train --heads
confidence --init-from DRAFTER`): DSpark's acceptance predictor, sigmoid(w . h_k + b) per block
row k, fitted by binary cross-entropy against the acceptance observed on the target's own
responses.

The rows and labels come by teacher forcing, as `evaluate.offline_eval` computes acceptance:
every response anchor's block drafted from the true context; row k is accepted when the
drafter's pick (the selector walk's, given the true token before it) is the target's token.
A row is tried only when every row before it was accepted, so the head learns P(row k
accepted | rows < k accepted), what `policy.acceptance` and the planner's cut read. Sequences
are split 9:1; the held-out tenth gives the head's calibration (`policy.acceptance.calibration`
of the predicted prefix acceptance), written to `<run>/heads.json`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from .. import log
from ..files import atomic_write
from ..model.drafter import Drafter
from ..model.dspark_heads import ConfidenceHead
from ..policy.acceptance import calibration
from .config import TrainConfig
from .data import FeatureStore
from .evaluate import eval_sequence
from .trainer import Batcher, head_matrix

LOG = log.get(__name__)
HEADS = ("confidence",)


def acceptance_rows(drafter: Drafter, batcher: Batcher, head_w: mx.array, i: int):
    """Sequence i's block rows (`evaluate.eval_sequence`) -> (hidden states [N, H] float16,
    accepted [N] bool: the drafter's pick, the selector's where it has one, is the target's
    token; row k [N]; anchor [N]; tried [N] bool: every row before it was accepted)."""
    res = eval_sequence(drafter, batcher, head_w, i, keep_hidden=True)
    picks = res.top1 if res.sel_top1 is None else res.sel_top1          # [A, K]
    A, K = picks.shape
    where, hs = res.hidden
    keep = where // K < A                                  # rows of the sequence's anchors
    where, hs = where[keep], hs[keep]
    before = np.cumprod(picks | ~res.valid, axis=1)        # rows 1..k all accepted
    tried = np.concatenate([np.ones((A, 1), bool), before[:, :-1] > 0], axis=1)
    return hs, picks.reshape(-1)[where], where % K + 1, where // K, tried.reshape(-1)[where]


def fit_confidence(x: np.ndarray, y: np.ndarray, steps: int = 400, lr: float = 0.05,
                   l2: float = 1e-4, seed: int = 0) -> ConfidenceHead:
    """A `ConfidenceHead` fitted by Adam on the mean binary cross-entropy of rows x [N, H]
    against y [N] (full batch), with a small L2 penalty."""
    mx.random.seed(seed)
    head = ConfidenceHead(x.shape[1])
    head.proj.weight = mx.zeros_like(head.proj.weight)
    base = float(np.clip(y.mean(), 1e-3, 1 - 1e-3))
    head.proj.bias = mx.array([np.log(base / (1 - base))], mx.float32)
    X, Y = mx.array(x.astype(np.float32)), mx.array(y.astype(np.float32))
    opt = optim.Adam(learning_rate=lr)

    def loss(model):
        z = model.proj(X)[:, 0]
        bce = mx.mean(nn.losses.binary_cross_entropy(z, Y, with_logits=True))
        return bce + l2 * mx.sum(model.proj.weight**2)

    grad = nn.value_and_grad(head, loss)
    for step in log.progress(range(steps), "confidence head"):
        value, g = grad(head)
        opt.update(head, g)
        mx.eval(head.parameters(), opt.state)
    return head


def train_confidence(drafter: Drafter, adapter, store: FeatureStore, run: Path,
                     seqs: list[int], seed: int = 0) -> dict:
    """Fit `drafter.confidence_head` (added, the rest untouched) on `seqs` of `store`, nine
    tenths of them; the held-out tenth's calibration -> the figures, also in
    `<run>/heads.json`."""
    rng = np.random.default_rng(seed)
    order = list(rng.permutation(seqs))
    held = set(order[: max(1, len(order) // 10)])
    batcher = Batcher(store, seqs, drafter.args, TrainConfig(soft_k=16), None, adapter.embed)
    head_w = head_matrix(adapter)
    parts = {True: [], False: []}
    for i in log.progress(batcher.seqs, "acceptance rows"):
        parts[i in held].append(acceptance_rows(drafter, batcher, head_w, i))
        mx.clear_cache()
    x, y, _, _, tried = (np.concatenate(c) for c in zip(*parts[False]))
    head = fit_confidence(x[tried], y[tried], seed=seed)
    figures = {"rows": int(tried.sum()), "accepted": float(y[tried].mean()),
               "held_out": held_out_figures(head, parts[True])}
    drafter.confidence_head = head
    drafter.args = dataclasses.replace(drafter.args, confidence_head=True)
    with atomic_write(Path(run) / "heads.json") as f:
        f.write(json.dumps(figures, indent=1) + "\n")
    LOG.info(f"confidence head: {figures['rows']} rows, held out: AUC "
             f"{figures['held_out']['auc']}, ECE {figures['held_out']['ece']}")
    return figures


def held_out_figures(head: ConfidenceHead, parts: list) -> dict:
    """Calibration of the head's predicted prefix acceptance on held-out sequences: for every
    row k of every anchor's block, the product of the predictions of rows 1..k against
    whether rows 1..k were all accepted."""
    records = []
    for hs, hit, k, anchor, _ in parts:
        a = np.array(head(mx.array(hs.astype(np.float32))))
        prefix, ok, last = 1.0, True, None
        for ai, yi, ki, an in zip(a, hit, k, anchor):
            if an != last:
                prefix, ok, last = 1.0, True, an
            prefix, ok = prefix * ai, ok and bool(yi)
            records.append((int(ki), float(prefix), ok))
    return calibration(records)
