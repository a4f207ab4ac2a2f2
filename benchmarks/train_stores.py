"""Rebuild the training feature stores from the committed token ids, and the HumanEval
evaluation store, without regenerating the training answers (resumable: rerun to continue).

    python benchmarks/train_stores.py --out runs --layers 1,2,8,11,15,16,17,18,22,23,27

  <out>/data1/   the first batch (data/smollm2_train_ids.npz), teacher-forced features
  <out>/data2/   the second batch (data/smollm2_train2_ids.npz)
  <out>/eval_he/ the target's greedy answers (256 new tokens) to the --eval-prompts shortest
                 HumanEval prompts, with features: evaluation only, never training data

The captured layers are a superset: drafters reading other target layers (or initialised from
other target layers, whose inputs `fc` picks) train on the same stores.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs"))
    p.add_argument("--layers", default="1,2,8,11,15,16,17,18,22,23,27")
    p.add_argument("--eval-prompts", type=int, default=48)
    p.add_argument("--eval-tokens", type=int, default=256)
    p.add_argument("--only", default="data1,data2,eval_he")
    a = p.parse_args(argv)

    import dflash2_mlx

    dflash2_mlx.use_fast_blas()      # before MLX loads: it binds to that BLAS as it loads
    from dflash2_mlx import log
    from dflash2_mlx.model.target import TargetAdapter
    from dflash2_mlx.train import data as D
    from dflash2_mlx.train.humaneval import humaneval_prompts
    from dflash2_mlx.train.recipe import load_target_for_training

    log.setup()      # the progress bars
    layers = tuple(int(x) for x in a.layers.split(","))
    target, tokenizer, path = load_target_for_training(None)
    adapter = TargetAdapter(target, layers)
    only = a.only.split(",")
    for name, ids in (("data1", "smollm2_train_ids.npz"), ("data2", "smollm2_train2_ids.npz")):
        if name not in only:
            continue
        seqs = D.load_token_ids(ROOT / "data" / ids)
        store = D.FeatureStore.create(a.out / name, layers, adapter.hidden_size, 16,
                                      adapter.vocab_size, {"model": path, "from": ids})
        t0 = time.perf_counter()
        D.capture_store(adapter, seqs, store, desc=name)
        print(f"{name}: {store.stats()} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    if "eval_he" in only:
        prompts = [D.encode_chat(tokenizer, t) for t in humaneval_prompts()]
        prompts = sorted(prompts, key=len)[: a.eval_prompts]
        store = D.FeatureStore.create(a.out / "eval_he", layers, adapter.hidden_size, 16,
                                      adapter.vocab_size, {"model": path, "from": "HumanEval"})
        cfg = D.GenConfig(max_new_tokens=a.eval_tokens, batch_size=16)
        D.generate_store(adapter, prompts, store, cfg, set(tokenizer.eos_token_ids), "g",
                         desc="eval_he")
        print(f"eval_he: {store.stats()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
