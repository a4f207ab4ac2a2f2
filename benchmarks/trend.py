"""Offline greedy tau of a training run's weight snapshots (tau against training blocks).

    python benchmarks/trend.py runs/abl_b --seqs 8 --eval-store runs/eval_he/greedy \\
        --out runs/trend_b.json [--min-step 0]

Snapshots come from `dflash2-mlx train --snapshot-every N` (`<run>/snapshots/step_*.safetensors`);
`--start DRAFTER` also evaluates the folder a continued run started from, as step 0.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import dflash2_mlx
import mlx.core as mx

from dflash2_mlx.loading.checkpoint import assets, checkpoint as loading
from dflash2_mlx.model.target import TargetAdapter
from dflash2_mlx.train import data as D
from dflash2_mlx.train import evaluate as E

from ablation import load_run  # (this script's folder)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("run", type=Path)
    p.add_argument("--eval-store", type=Path, required=True)
    p.add_argument("--seqs", type=int, default=8, help="an even spread of N stored sequences")
    p.add_argument("--min-step", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--start", default=None, metavar="DRAFTER",
                   help="the drafter folder a run was continued from (`train --init-from`): "
                   "evaluated as step 0")
    a = p.parse_args(argv)
    model, _, _ = loading.load_target(str(assets.smollm2_gguf()), mx.float32)
    adapter = TargetAdapter(model)
    store = D.FeatureStore(a.eval_store)
    seqs = list(range(0, len(store), max(1, len(store) // a.seqs)))[: a.seqs]
    points = []

    def add(step: int, blocks: int, drafter) -> None:
        r = E.offline_eval(drafter, adapter, store, seqs)
        points.append({"step": step, "blocks": blocks, "tau_argmax": r["tau_argmax"],
                       "tau_selector": r.get("tau_selector"), "recall1_k1": r["recall1"][0]})
        print(points[-1], flush=True)
        a.out.write_text(json.dumps({"eval_sequences": len(seqs), "points": points}, indent=1))

    if a.start:
        add(0, 0, loading.load_drafter(a.start, hidden_size=adapter.hidden_size,
                                       vocab_size=adapter.vocab_size,
                                       num_layers=adapter.num_layers, dtype=mx.float32))
    for snap in sorted((a.run / "snapshots").glob("step_*.safetensors")):
        step = int(snap.stem.split("_")[1])
        if step >= a.min_step:
            blocks = int(mx.load(str(snap), return_metadata=True)[1]["blocks"])
            add(step, blocks, load_run(a.run, snap))
    return 0


if __name__ == "__main__":
    dflash2_mlx.use_fast_blas()      # MLX's float32 matmuls on MKL / OpenBLAS (Linux)
    raise SystemExit(main())
