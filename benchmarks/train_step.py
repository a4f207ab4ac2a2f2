"""Seconds per training step of the recipe's drafter on a real feature store, with a breakdown:
the whole compiled step (what `train` runs), the drafter body's forward, and the head with its
losses (forward + backward from fixed hidden states).

    python benchmarks/train_step.py --store runs/data1 --steps 6

Run it with PYTHONPATH pointing at another checkout to time that code on the same batches
(the figures in docs/training.md compare two commits that way, alternating, in one session).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--store", type=Path, nargs="+", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--anchors", type=int, default=64)
    p.add_argument("--target-layer-ids", default="1,8,15,22,27")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="mx.compile the step (default: TrainConfig's)")
    a = p.parse_args(argv)

    import dflash2_mlx

    dflash2_mlx.use_fast_blas()      # before MLX loads: it binds to that BLAS as it loads
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np

    from dflash2_mlx.model.target import TargetAdapter
    from dflash2_mlx.train import data as D
    from dflash2_mlx.train import trainer as T
    from dflash2_mlx.train.config import DrafterShape
    from dflash2_mlx.train.init import drafter_args_for, init_drafter
    from dflash2_mlx.train.losses import block_loss, selector_loss
    from dflash2_mlx.train.packed import packed_hidden
    from dflash2_mlx.train.recipe import load_target_for_training

    print(f"code: {Path(dflash2_mlx.__file__).parent}", file=sys.stderr)
    target, _, _ = load_target_for_training(None)
    plain = TargetAdapter(target)
    store = D.FeatureStore(*a.store)
    layers = tuple(int(x) for x in a.target_layer_ids.split(","))
    args = drafter_args_for(plain, DrafterShape(target_layer_ids=layers))   # SmolLM2: mask 16
    drafter = init_drafter(args, plain, [plain.num_layers - 2, plain.num_layers - 1], seed=0)
    cfg = T.TrainConfig(steps=1000, seqs=a.seqs, anchors=a.anchors)
    seqs = list(range(len(store)))
    vocab = T.build_vocab(store, seqs, cfg.soft_k, [args.mask_token_id])
    head_w = T.head_matrix(plain)[mx.array(vocab)]
    vocab_mx = mx.array(vocab)
    batcher = T.Batcher(store, seqs, args, cfg, vocab, plain.embed)
    windows = T.windows_of(drafter)
    opt = T.make_optimizer(cfg)
    opt.init(drafter.trainable_parameters())
    compile = cfg.compile if a.compile is None else a.compile
    step = T.make_step(drafter, opt, head_w, vocab_mx, cfg, windows, compile=compile)
    batches = [batcher.make(np.random.default_rng([0, s]), windows=windows)
               for s in range(a.steps + 1)]
    print(f"vocab {len(vocab)}, rows per step {int((batches[0].position > 0).sum())}, "
          f"compiled {compile}",
          file=sys.stderr)

    def timed(fn, batch):
        tic = time.perf_counter()
        mx.eval(fn(batch))
        return time.perf_counter() - tic

    def whole(batch):
        loss, gnorm, m = step(batch)
        return loss, gnorm, m, drafter.state, opt.state

    def body(batch):
        return packed_hidden(drafter, batch.x, batch.feats, batch.anchors, batch.ctx_visible,
                             batch.block_visible)

    def head(batch, hr):
        def f(h):
            logits = drafter.logits(h, lambda z: z @ head_w.T)
            loss, _ = block_loss(logits, batch.labels, batch.weights, batch.teacher_ids,
                                 batch.teacher_lp, cfg.soft)
            scores, cand = T.selector_terms(drafter, h, logits, vocab_mx, batch)
            return loss + selector_loss(scores, cand, batch.labels, batch.weights)[0]
        return mx.value_and_grad(f)(hr)

    def body_grad(batch):
        def f(model):
            h = packed_hidden(model, batch.x, batch.feats, batch.anchors, batch.ctx_visible,
                              batch.block_visible)
            return (h * h).sum()
        return nn.value_and_grad(drafter, f)(drafter)

    timed(whole, batches[0])                  # compile
    res = {"step": [], "body forward": [], "body fwd+bwd": [], "head + losses fwd+bwd": []}
    for b in batches[1:]:
        res["step"].append(timed(whole, b))
        res["body forward"].append(timed(body, b))
        res["body fwd+bwd"].append(timed(body_grad, b))
        hr = mx.stop_gradient(body(b)[:, :, 1:].reshape(-1, args.hidden_size))
        mx.eval(hr)
        res["head + losses fwd+bwd"].append(timed(lambda bb: head(bb, hr), b))
    for k, v in res.items():
        print(f"{k:24s} median {statistics.median(v):.3f} s  (min {min(v):.3f})")
    blocks = statistics.mean(b.blocks for b in batches[1:])
    print(f"blocks/s {blocks / statistics.median(res['step']):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
