"""Drafter variants side by side (issue #14's copying ablation): offline tau and per-row
Recall@1 / @16 on HumanEval answers, real tau through the pipeline at b = 8 with and without
lookup, and the draft's cost per cycle.

    python benchmarks/copy_ablation.py --run base=runs/abl_base --run copy=runs/abl_copy \\
        --eval-store runs/eval_he --seqs 24 --prompts 8 --max-tokens 96 --out docs/bench/copy

Each --run is a training run folder (its newest checkpoint and training vocabulary). Writes
<out>/copy_ablation.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import dflash2_mlx
import mlx.core as mx

from ablation import cycle_times, load_run
from dflash2_mlx.loading.checkpoint import assets, checkpoint as loading
from dflash2_mlx.model.target import TargetAdapter
from dflash2_mlx.train import data as D
from dflash2_mlx.train.evaluate import offline_eval, real_eval
from dflash2_mlx.train.export import export_drafter
from dflash2_mlx.train.humaneval import humaneval_prompts


def real_tau(draft: str | None, prompts: list[str], max_tokens: int) -> dict:
    """Mean tau per prompt on the embedded target, greedy, b = 8, without and with lookup;
    `draft` None: the shipped drafter."""
    pipe = dflash2_mlx.load(None, draft)
    return {f"tau_{label}": real_eval(pipe, prompts, max_tokens=max_tokens, block_size=8,
                                      lookup=lookup)["tau"]
            for label, lookup in (("alone", False), ("hybrid", True))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--run", action="append", default=[], metavar="NAME=FOLDER")
    p.add_argument("--shipped", action="store_true", help="also the shipped drafter (real only)")
    p.add_argument("--eval-store", type=Path, required=True)
    p.add_argument("--seqs", type=int, default=24, help="every other of the first 2N answers")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    target, _, _ = loading.load_target(str(assets.smollm2_gguf()), mx.float32)
    adapter = TargetAdapter(target)
    store = D.FeatureStore(a.eval_store)
    seqs = list(range(len(store)))[::2][: a.seqs]
    every = max(1, 164 // a.prompts)
    prompts = humaneval_prompts()[::every][: a.prompts]
    results = {}
    if a.shipped:
        results["shipped"] = real_tau(None, prompts, a.max_tokens)
        print("shipped", results["shipped"], file=sys.stderr, flush=True)
    for spec in a.run:
        name, folder = spec.split("=", 1)
        drafter = load_run(Path(folder))
        tic = time.perf_counter()
        off = offline_eval(drafter, adapter, store, seqs)
        res = {"offline_tau": off["tau_selector"], "recall1": off["selector_recall1"],
               "recall16": off["recall16"], "anchors": off["anchors"],
               "target_layer_ids": list(drafter.args.target_layer_ids),
               "offline_s": time.perf_counter() - tic}
        res["draft_ms"] = cycle_times({name: drafter}, adapter)[f"{name}/greedy"]
        with tempfile.TemporaryDirectory() as tmp:
            export_drafter(drafter, Path(tmp) / "d", bits=4)
            res.update(real_tau(str(Path(tmp) / "d"), prompts, a.max_tokens))
        results[name] = res
        print(name, json.dumps({k: v for k, v in res.items() if not isinstance(v, list)}),
              file=sys.stderr, flush=True)
        mx.clear_cache()
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "copy_ablation.json").write_text(json.dumps(
            {"results": results, "eval_sequences": len(seqs), "prompts": a.prompts,
             "max_tokens": a.max_tokens}, indent=1))
    print("| variant | offline tau | real tau alone | real tau hybrid | R@1 k=1..7 | "
          "R@16 k=1..7 | draft ms |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        row = [f"{r['offline_tau']:.3f}" if "offline_tau" in r else "-",
               f"{r['tau_alone']:.2f}", f"{r['tau_hybrid']:.2f}",
               " ".join(f"{x * 100:.0f}" for x in r.get("recall1", [])) or "-",
               " ".join(f"{x * 100:.0f}" for x in r.get("recall16", [])) or "-",
               f"{r['draft_ms']:.1f}" if "draft_ms" in r else "-"]
        print(f"| {name} | " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    dflash2_mlx.use_fast_blas()      # MLX's float32 matmuls on MKL / OpenBLAS (Linux)
    raise SystemExit(main())
