"""The training loop: packed blocks, weighted CE / distillation, selector CE, AdamW, checkpoints.

Each step takes `seqs` sequences of similar length from a `FeatureStore` and redraws up to
`anchors` random anchor positions among each one's response tokens. A block at anchor a is
[x_a, M, ..., M]; row k (1..B-1) predicts x_{a+k} with weight exp(-(k-1)/gamma). The head is
the target's (frozen), restricted during training to the sub-vocabulary the data can need
(`build_vocab`: every response token and the target's top-k ids); evaluation uses the full one.

Checkpoints (`<run>/ckpt/step_NNNNNN/`: fp32 weights, optimizer state, progress) are written
every `ckpt_every` steps and at the end; `train` resumes from the newest one.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .. import log
from ..model.config import DrafterArgs
from ..model.drafter import Drafter, DraftVocab
from ..files import atomic_path
from ..decode.lookup import LookupConfig, LookupIndex
from ..model.topk import top_k_indices
from . import host_exp
from .config import TrainConfig
from .data import FeatureStore
from .losses import block_loss, selector_loss, selector_scores
from .masks import block_mask, context_mask, default_gamma, position_weights
from .packed import packed_hidden


@dataclass
class Batch:
    x: mx.array                 # [N, A, B, H] embedded blocks
    feats: mx.array             # [N, S, F]
    anchors: mx.array           # [N, A]
    ctx_visible: dict           # window -> bool [N, A*B, S]
    block_visible: mx.array     # [B, B]
    rows: mx.array | None       # [R] kept rows of the flat [N*A*(B-1)] ones (None: all)
    labels: mx.array            # [R] indices into the vocabulary used by the head
    label_ids: mx.array         # [R] token ids
    prev_ids: mx.array          # [R] the true predecessor token ids
    weights: mx.array           # [R]
    teacher_ids: mx.array       # [R, k] indices into the head's vocabulary
    teacher_lp: mx.array        # [R, k]
    position: np.ndarray = field(default=None)  # [R] block row k (0: padding), host side
    blocks: int = 0


# --------------------------------------------------------------------------- data -> batches

def copy_rows(tokens: np.ndarray, start: int, rows: int) -> np.ndarray:
    """[T, rows] bool: row k of the block anchored at position p (p >= start) is one a lookup
    cycle would accept - the lookup over tokens[: p + 1] (`LookupIndex`, default n-grams)
    proposes tokens[p + 1 .. p + k], every row up to k agreeing. Where the target copies its
    context: the positions the drafter is weakest at."""
    out = np.zeros((len(tokens), rows), bool)
    index = LookupIndex(LookupConfig(), tokens[:start].tolist())
    for p in range(start, len(tokens) - 1):
        index.extend([int(tokens[p])])
        found = index.propose(rows)
        for k, guess in enumerate(found[1] if found else []):
            if p + k + 1 >= len(tokens) or guess != tokens[p + k + 1]:
                break
            out[p, k] = True
    return out


def build_vocab(store: FeatureStore, seqs: Sequence[int], soft_k: int,
                extra: Sequence[int] = ()) -> np.ndarray:
    """Sorted ids the training softmax covers: every response token, the target's top-`soft_k`
    ids at every response position, and `extra` (mask, EOS)."""
    seen = np.zeros(store.manifest["vocab_size"], bool)
    for i in seqs:
        toks = store.tokens(i)
        seen[toks[store.prompt_len(i):]] = True
        ids, _ = store.topk(i)
        seen[np.asarray(ids[:, :soft_k]).reshape(-1)] = True
    seen[list(extra)] = True
    return np.nonzero(seen)[0]


class Batcher:
    """Draws training batches from a store (random anchors redrawn at every call)."""

    def __init__(self, store: FeatureStore, seqs: Sequence[int], args: DrafterArgs,
                 cfg: TrainConfig, vocab: np.ndarray | None, embed):
        self.store, self.args, self.cfg, self.embed = store, args, cfg, embed
        store.check_layers(args.target_layer_ids)
        lengths = {i: len(store.tokens(i)) for i in seqs}
        # An anchor needs at least one label after it: responses of >= 2 tokens.
        self.seqs = sorted((i for i in seqs if lengths[i] - store.prompt_len(i) >= 2),
                           key=lambda i: (lengths[i], i))
        if not self.seqs:
            raise ValueError(f"{store.folder}: no sequence has a response of 2+ tokens")
        self.lengths = lengths
        V = store.manifest["vocab_size"]
        self.vocab = vocab
        self.index = np.full(V, -1, np.int64)
        if vocab is not None:
            self.index[vocab] = np.arange(len(vocab))
        else:
            self.index = np.arange(V)
        self.weights = position_weights(args.block_size,
                                        cfg.gamma or default_gamma(args.block_size))
        self._copies: dict[int, np.ndarray] = {}       # sequence -> copy_rows, on first use

    def copies(self, i: int) -> np.ndarray:
        if i not in self._copies:
            self._copies[i] = copy_rows(np.asarray(self.store.tokens(i)).astype(np.int64),
                                        self.store.prompt_len(i), self.args.block_size - 1)
        return self._copies[i]

    def pick(self, rng: np.random.Generator) -> list[int]:
        """`cfg.seqs` sequences of similar length (a random window of the length-sorted list)."""
        n = min(self.cfg.seqs, len(self.seqs))
        span = min(len(self.seqs), 4 * n)
        start = rng.integers(0, len(self.seqs) - span + 1)
        return sorted(rng.choice(self.seqs[start:start + span], n, replace=False).tolist())

    def _gather(self, rng, seqs: list[int], spans: list[tuple[int, int]], S: int, A: int,
                kt: int) -> tuple[np.ndarray, ...]:
        """The arrays of a batch over `seqs` (prompt and total length in `spans`), `S`
        context rows, `A` anchors per sequence (all of them when they fit, else a random
        choice) and the teacher's `kt` likeliest tokens per label."""
        store, args, B = self.store, self.args, self.args.block_size
        N = len(seqs)
        feats = np.zeros((N, S, len(args.target_layer_ids) * store.hidden), np.float16)
        anchors = np.full((N, A), -1, np.int64)
        block = np.full((N, A, B), args.mask_token_id, np.int64)
        labels = np.zeros((N, A, B - 1), np.int64)
        prev = np.zeros((N, A, B - 1), np.int64)
        valid = np.zeros((N, A, B - 1), bool)
        copied = np.zeros((N, A, B - 1), bool)
        t_ids = np.zeros((N, A, B - 1, kt), np.int64)
        t_lp = np.zeros((N, A, B - 1, kt), np.float32)
        for n, (i, (P, T)) in enumerate(zip(seqs, spans)):
            toks = np.asarray(store.tokens(i)).astype(np.int64)
            f = store.feats(i, args.target_layer_ids)
            feats[n, : len(f)] = f
            cand = np.arange(P, T - 1)                   # anchors with >= 1 label after them
            if len(cand) > A:
                cand = np.sort(rng.choice(cand, A, replace=False))
            m = len(cand)
            anchors[n, :m] = cand
            block[n, :m, 0] = toks[cand]
            ids, lp = store.topk(i)
            if self.cfg.copy_weight:
                copied[n, :m] = self.copies(i)[cand]
            for k in range(1, B):
                p = np.minimum(cand + k, T - 1)
                labels[n, :m, k - 1] = toks[p]
                prev[n, :m, k - 1] = toks[p - 1]
                valid[n, :m, k - 1] = cand + k < T
                t_ids[n, :m, k - 1] = ids[p - P, :kt]
                t_lp[n, :m, k - 1] = lp[p - P, :kt]
        return feats, anchors, block, labels, prev, valid, copied, t_ids, t_lp

    def make(self, rng: np.random.Generator | None, seqs: Sequence[int] | None = None,
             all_anchors: bool = False, windows: Sequence[int | None] = (None,),
             pad_to: int = 64) -> Batch:
        """A batch of `cfg.seqs` sequences with `cfg.anchors` random anchors each (or every
        anchor of `seqs`). Training batches keep every row (padding rows weigh 0) and pad the
        context to a multiple of `pad_to`, so that shapes repeat and the step compiles once
        per shape; with `all_anchors` only rows with a label are kept (`rows`)."""
        store, args, B = self.store, self.args, self.args.block_size
        seqs = self.pick(rng) if seqs is None else list(seqs)
        N = len(seqs)
        spans = [(store.prompt_len(i), self.lengths[i]) for i in seqs]
        S = max(T - 1 for _, T in spans)
        S = -(-S // pad_to) * pad_to
        A = max(T - 1 - P for P, T in spans) if all_anchors else self.cfg.anchors
        kt = min(self.cfg.soft_k, int(store.manifest["topk"]))
        feats, anchors, block, labels, prev, valid, copied, t_ids, t_lp = self._gather(
            rng, seqs, spans, S, A, kt)
        position = np.tile(np.arange(1, B), N * A)
        rows = np.nonzero(valid.reshape(-1))[0] if all_anchors else np.arange(N * A * (B - 1))
        lab = labels.reshape(-1)[rows]
        tid = t_ids.reshape(-1, kt)[rows]
        weights = (self.weights[position[rows] - 1] * valid.reshape(-1)[rows]
                   * (1 + self.cfg.copy_weight * copied.reshape(-1)[rows]))
        vis = {w: mx.array(context_mask(anchors, B, S, w)) for w in windows}
        return Batch(
            x=self.embed(mx.array(block.reshape(N, A * B))).reshape(N, A, B, -1),
            feats=mx.array(feats).astype(mx.float32), anchors=mx.array(anchors),
            ctx_visible=vis, block_visible=mx.array(block_mask(B, args.is_causal)),
            rows=mx.array(rows) if all_anchors else None,
            labels=mx.array(np.maximum(self.index[lab], 0)), label_ids=mx.array(lab),
            prev_ids=mx.array(prev.reshape(-1)[rows]), weights=mx.array(weights),
            teacher_ids=mx.array(np.maximum(self.index[tid], 0)),
            teacher_lp=mx.array(np.where(self.index[tid] >= 0, t_lp.reshape(-1, kt)[rows],
                                         -1e4)),
            position=np.where(valid.reshape(-1)[rows], position[rows], 0),
            blocks=int((anchors >= 0).sum()))


def windows_of(drafter: Drafter) -> list:
    return sorted({l.self_attn.window for l in drafter.layers}, key=lambda w: (w is not None, w))


# --------------------------------------------------------------------------- the loss

def head_matrix(adapter) -> mx.array:
    """The target's output projection as a [V, H] matrix (lm_head or the tied embedding)."""
    head = adapter.head_module()
    if isinstance(head, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        raise ValueError("the target's head is quantized: load the target in float32 to train")
    return head.weight


def forward_rows(drafter: Drafter, batch: Batch, head_w: mx.array) -> tuple[mx.array, mx.array]:
    """-> (final hidden [R, H], logits [R, V'] over the head rows `head_w` [V', H])."""
    h = packed_hidden(drafter, batch.x, batch.feats, batch.anchors, batch.ctx_visible,
                      batch.block_visible)
    H = h.shape[-1]
    hr = h[:, :, 1:].reshape(-1, H)
    if batch.rows is not None:
        hr = hr[batch.rows]
    return hr, drafter.logits(hr, lambda z: z @ head_w.T)


def selector_terms(drafter: Drafter, hr: mx.array, logits: mx.array, vocab: mx.array | None,
                   batch: Batch):
    """Scores [R, K] of the top-K candidates (indices [R, K] into the head's vocabulary) given
    the true predecessor.

    The selector is trained as a head on top of the drafter: no gradient reaches the drafter's
    body or logits through it, so a drafter trained with a selector has exactly the body of
    the same run without one (the ablation compares both from one run)."""
    sel = drafter.candidate_selector
    K = sel.top_k
    hr = mx.stop_gradient(hr)
    lg = mx.stop_gradient(logits)
    cand = top_k_indices(lg, K)
    unary = mx.take_along_axis(lg, cand, axis=-1)
    cand_ids = cand if vocab is None else vocab[cand]
    scores = selector_scores(unary, sel.hidden_projection(hr),
                             sel.predecessor_codebook(batch.prev_ids),
                             sel.successor_codebook(cand_ids))
    return scores, cand


def loss_fn(drafter: Drafter, batch: Batch, head_w: mx.array, vocab: mx.array | None,
            cfg: TrainConfig):
    hr, logits = forward_rows(drafter, batch, head_w)
    loss, ce = block_loss(logits, batch.labels, batch.weights, batch.teacher_ids,
                          batch.teacher_lp, cfg.soft)
    acc = mx.argmax(logits, axis=-1) == batch.labels
    metrics = {"ce": (ce * batch.weights).sum() / batch.weights.sum(), "acc": acc}
    if drafter.args.has_selector:
        scores, cand = selector_terms(drafter, hr, logits, vocab, batch)
        sl, hit = selector_loss(scores, cand, batch.labels, batch.weights)
        loss = loss + cfg.selector_weight * sl
        pick = mx.take_along_axis(cand, mx.argmax(scores, -1)[:, None], -1)[:, 0]
        metrics.update(sel=sl, hit=hit, sel_acc=pick == batch.labels)
    return loss, metrics


# --------------------------------------------------------------------------- the loop

BATCH_FIELDS = ("x", "feats", "anchors", "block_visible", "labels", "label_ids", "prev_ids",
                "weights", "teacher_ids", "teacher_lp")


def make_step(drafter: Drafter, opt: optim.Optimizer, head_w: mx.array,
              vocab: mx.array | None, cfg: TrainConfig, windows: Sequence, compile: bool = True):
    """One optimisation step on a training batch (all rows kept), compiled once per shape:
    -> step(batch) -> (loss, metrics dict)."""
    value_and_grad = nn.value_and_grad(drafter, lambda m, b: loss_fn(m, b, head_w, vocab, cfg))
    keys = ["ce", "acc"] + (["sel", "hit", "sel_acc"] if drafter.args.has_selector else [])

    def step(*arrays):
        fields = dict(zip(BATCH_FIELDS, arrays))
        vis = dict(zip(windows, arrays[len(BATCH_FIELDS):]))
        batch = Batch(ctx_visible=vis, rows=None, **fields)
        (loss, m), grads = value_and_grad(drafter, batch)
        grads, gnorm = optim.clip_grad_norm(grads, cfg.clip)
        opt.update(drafter, grads)
        return (loss, gnorm, *[m[k] for k in keys])

    if compile:
        state = [drafter.state, opt.state]
        step = mx.compile(step, inputs=state, outputs=state)

    def run(batch: Batch):
        arrays = [getattr(batch, f) for f in BATCH_FIELDS] + [batch.ctx_visible[w] for w in windows]
        with host_exp.disabled() if compile else contextlib.nullcontext():
            loss, gnorm, *rest = step(*arrays)
        return loss, gnorm, dict(zip(keys, rest))

    return run



def make_optimizer(cfg: TrainConfig) -> optim.Optimizer:
    warm = max(1, int(cfg.warmup * cfg.steps))
    decay = optim.cosine_decay(cfg.lr, max(1, cfg.steps - warm), cfg.lr * cfg.min_lr)
    schedule = optim.join_schedules([optim.linear_schedule(cfg.lr * 0.01, cfg.lr, warm), decay],
                                    [warm])
    return optim.AdamW(learning_rate=schedule, betas=[0.9, 0.95], weight_decay=cfg.weight_decay)


def latest_checkpoint(run: Path) -> Path | None:
    ckpts = sorted((run / "ckpt").glob("step_*"))
    return ckpts[-1] if ckpts else None


def save_checkpoint(run: Path, drafter: Drafter, opt: optim.Optimizer, step: int,
                    extra: dict, keep: int) -> Path:
    folder = run / "ckpt" / f"step_{step:06d}"
    with atomic_path(folder) as tmp:        # a checkpoint is there whole or not at all
        tmp.mkdir(exist_ok=True)
        mx.save_safetensors(str(tmp / "weights.safetensors"),
                            dict(tree_flatten(drafter.parameters())))
        mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(opt.state)))
        (tmp / "state.json").write_text(json.dumps({"step": step,
                                                    "args": drafter.args.to_config(), **extra},
                                                   indent=1))
        shutil.rmtree(folder, ignore_errors=True)     # a folder is renamed only onto none
    for old in sorted((run / "ckpt").glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return folder


def load_checkpoint(folder: Path, drafter: Drafter, opt: optim.Optimizer | None) -> dict:
    drafter.load_weights(list(mx.load(str(folder / "weights.safetensors")).items()), strict=True)
    if opt is not None:
        opt.state = tree_unflatten(list(mx.load(str(folder / "optimizer.safetensors")).items()))
    return json.loads((folder / "state.json").read_text())


def train(drafter: Drafter, adapter, store: FeatureStore, run: str | Path, cfg: TrainConfig,
          seqs: Sequence[int] | None = None, on_step=None) -> Drafter:
    """Train `drafter` in place on `store`; checkpoints and `train_log.jsonl` go to `run`.

    `on_step(record)` gets each step's record (the line of `train_log.jsonl`). Resumes from the
    newest checkpoint in `run`; the steps show as a progress bar (`dflash2_mlx.log.progress`).
    """
    run = Path(run)
    run.mkdir(parents=True, exist_ok=True)
    seqs = list(range(len(store))) if seqs is None else list(seqs)
    args = drafter.args
    vocab = _training_vocab(run, store, seqs, cfg, [args.mask_token_id])
    # The drafter proposes from the ids it was trained on (exported as draft_vocab.json).
    drafter.draft_vocab = None if vocab is None else DraftVocab(vocab)
    head_full = head_matrix(adapter)
    head_w = head_full if vocab is None else head_full[mx.array(vocab)]
    vocab_mx = None if vocab is None else mx.array(vocab)
    batcher = Batcher(store, seqs, args, cfg, vocab, adapter.embed)
    windows = windows_of(drafter)
    opt = make_optimizer(cfg)
    start, done_blocks = _resume(run, drafter, opt)
    (run / "train_config.json").write_text(json.dumps(
        {"train": asdict(cfg), "drafter": args.to_config(), "data": [str(f) for f in store.folders],
         "sequences": len(batcher.seqs), "vocab": None if vocab is None else len(vocab)},
        indent=1))
    step_fn = make_step(drafter, opt, head_w, vocab_mx, cfg, windows, compile=cfg.compile)
    bar = log.progress(range(start, cfg.steps), "train", total=cfg.steps, initial=start)
    logf = open(run / "train_log.jsonl", "a")
    t0, blocks = time.perf_counter(), 0
    try:
        for step in bar:
            rng = np.random.default_rng([cfg.seed, step])
            batch = batcher.make(rng, windows=windows)
            loss, gnorm, m = step_fn(batch)
            mx.eval(loss, gnorm, m, drafter.state, opt.state)
            blocks += batch.blocks
            rec = step_record(step + 1, loss, m, gnorm, batch, args.block_size, opt,
                              blocks / (time.perf_counter() - t0))
            rec["total_blocks"] = done_blocks + blocks
            logf.write(json.dumps(rec) + "\n")
            bar.set_postfix_str(summary(rec))
            if on_step:
                on_step(rec)
            if _after_step(run, drafter, opt, cfg, logf, step, done_blocks + blocks,
                           time.perf_counter() - t0):
                break
    finally:
        logf.close()
    return drafter


def _training_vocab(run: Path, store: FeatureStore, seqs: list[int], cfg: TrainConfig,
                    extra_ids: list[int]) -> np.ndarray | None:
    """The draft vocabulary (`cfg.vocab == "data"`: the ids the data uses, `run/vocab.npy`,
    built once), or None for the full vocabulary."""
    if cfg.vocab != "data":
        return None
    path = run / "vocab.npy"
    if path.exists():
        return np.load(path)
    vocab = build_vocab(store, seqs, cfg.soft_k, extra_ids)
    np.save(path, vocab)
    return vocab


def _resume(run: Path, drafter: Drafter, opt) -> tuple[int, int]:
    """(steps done, blocks done): from the newest checkpoint in `run`, else a fresh start."""
    ckpt = latest_checkpoint(run)
    if ckpt is None:
        opt.init(drafter.trainable_parameters())
        return 0, 0
    state = load_checkpoint(ckpt, drafter, opt)
    return state["step"], state.get("blocks", 0)


def _after_step(run: Path, drafter: Drafter, opt, cfg: TrainConfig, logf, step: int,
                blocks: int, elapsed: float) -> bool:
    """After step `step` (0-based), `blocks` trained in all: the checkpoints and snapshots
    due; True when `cfg.max_minutes` ran out (a checkpoint is saved: stop)."""
    done = step + 1
    if done % cfg.ckpt_every == 0 or done == cfg.steps:
        logf.flush()
        save_checkpoint(run, drafter, opt, done, {"blocks": blocks}, cfg.keep_ckpts)
    if cfg.snapshot_every and done % cfg.snapshot_every == 0:
        (run / "snapshots").mkdir(exist_ok=True)
        mx.save_safetensors(str(run / "snapshots" / f"step_{done:06d}.safetensors"),
                            dict(tree_flatten(drafter.parameters())), {"blocks": str(blocks)})
    if step % 50 == 0:
        mx.clear_cache()
    if cfg.max_minutes and elapsed > 60 * cfg.max_minutes:
        save_checkpoint(run, drafter, opt, done, {"blocks": blocks}, cfg.keep_ckpts)
        return True
    return False


def step_record(step, loss, m, gnorm, batch: Batch, B: int, opt, blocks_per_s: float) -> dict:
    acc = np.array(m["acc"])
    rec = {"step": step, "loss": float(loss), "ce": float(m["ce"]), "gnorm": float(gnorm),
           "lr": float(opt.learning_rate), "blocks": batch.blocks,
           "rows": int((batch.position > 0).sum()),
           "blocks_per_s": blocks_per_s,
           "acc": [float(acc[batch.position == k].mean()) if (batch.position == k).any()
                   else None for k in range(1, B)]}
    if "sel" in m:
        ok = batch.position > 0
        hit, sel_acc = np.array(m["hit"])[ok], np.array(m["sel_acc"])[ok]
        rec["sel"] = float(m["sel"])
        rec["recall16"] = float(hit.mean())
        rec["sel_acc"] = float(sel_acc.mean())
    return rec


def summary(rec: dict) -> str:
    accs = "/".join(f"{a * 100:.0f}" if a is not None else "-" for a in rec["acc"])
    text = f"loss {rec['loss']:.3f} acc% {accs}"
    if "sel" in rec:
        text += f" sel {rec['sel']:.2f} r16 {rec['recall16'] * 100:.0f}"
    return text
