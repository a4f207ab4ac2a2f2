"""Ablation of the DFlash 2 parts on HumanEval prompts (issue #5): DFlash, + selector, + conv,
DFlash 2, from two training runs at an equal data and step budget.

The selector is trained as a head (no gradient into the drafter's body), so a run without
convolution gives both "DFlash" (its argmax) and "+ selector" (its walk), and a run with the
convolution gives "+ conv" and "DFlash 2", each pair from one body.

    python benchmarks/ablation.py --no-conv-run runs/abl_a --conv-run runs/abl_b \\
        --eval-store runs/eval_he/greedy --out docs

Writes <out>/ablation.json and <out>/recall.png (matplotlib is needed for the plot only; it is
not a dependency of the package). Offline figures: `dflash2_mlx.train.evaluate`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import dflash2_mlx
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from dflash2_mlx.loading.checkpoint import assets, checkpoint as loading
from dflash2_mlx.model.config import DrafterArgs
from dflash2_mlx.model.drafter import Drafter, DraftVocab
from dflash2_mlx.decode.sampling import Sampling
from dflash2_mlx.model.target import TargetAdapter
from dflash2_mlx.train import data as D
from dflash2_mlx.train.evaluate import offline_eval
from dflash2_mlx.train.trainer import latest_checkpoint

VARIANTS = (("DFlash", "no_conv", False), ("+ selector", "no_conv", True),
            ("+ conv", "conv", False), ("DFlash 2", "conv", True))


def load_run(run: Path, weights: Path | None = None) -> Drafter:
    cfg = json.loads((run / "train_config.json").read_text())
    drafter = Drafter(DrafterArgs.from_dict(cfg["drafter"]))
    weights = weights or latest_checkpoint(run) / "weights.safetensors"
    drafter.load_weights(list(mx.load(str(weights)).items()), strict=True)
    mx.eval(drafter.parameters())
    if (run / "vocab.npy").is_file():       # the training softmax's ids: exported with it
        drafter.draft_vocab = DraftVocab(np.load(run / "vocab.npy"))
    return drafter


def without_selector(drafter: Drafter) -> Drafter:
    """The same body as a drafter without the selector (DFlash when it has no convolution)."""
    from dataclasses import replace

    from dflash2_mlx.model.config import DFLASH

    a = drafter.args
    args = replace(a, selector_rank=0, selector_top_k=0,
                   architecture=a.architecture if a.has_conv else DFLASH)
    out = Drafter(args)
    params = [(k, v) for k, v in tree_flatten(drafter.parameters())
              if not k.startswith("candidate_selector.")]
    out.load_weights(params, strict=True)
    return out


def cycle_times(drafters: dict, adapter: TargetAdapter, ctx_len: int = 300, reps: int = 15,
                block: int = 8) -> dict:
    """Median ms of one draft (b = 8, greedy and T = 1) after `ctx_len` context rows, and of
    one target verify of b rows."""
    F = len(next(iter(drafters.values())).args.target_layer_ids) * adapter.hidden_size
    feats = mx.random.normal((1, ctx_len, F)) * 0.5
    anchor = mx.array([[42]], dtype=mx.uint32)
    out = {}
    for name, drafter in drafters.items():
        for label, sampling in (("greedy", Sampling(0.0)), ("t1", Sampling(1.0))):
            times = []
            for r in range(reps + 2):
                cache = drafter.make_cache()
                drafter.propose(adapter, anchor, feats, cache, block, sampling, mx.random.key(r))
                mx.eval([c.state for c in cache])
                t = time.perf_counter()
                p = drafter.propose(adapter, anchor, None, cache, block, sampling,
                                    mx.random.key(r))
                mx.eval(p.tokens, p.q if p.q is not None else p.tokens)
                if r >= 2:
                    times.append((time.perf_counter() - t) * 1000)
            out[f"{name}/{label}"] = statistics.median(times)
    cache = adapter.make_cache()
    ids = mx.random.randint(100, 1000, (1, ctx_len)).astype(mx.uint32)
    adapter.forward(ids, cache)
    mx.eval([c.state for c in cache])
    times = []
    for r in range(reps + 2):
        t = time.perf_counter()
        logits, _ = adapter.forward(ids[:, :block], cache)
        mx.eval(logits)
        adapter.trim(cache, block) if hasattr(adapter, "trim") else [c.trim(block) for c in cache]
        if r >= 2:
            times.append((time.perf_counter() - t) * 1000)
    out["verify"] = statistics.median(times)
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    colors = {"DFlash": "tab:gray", "+ selector": "tab:blue", "+ conv": "tab:orange",
              "DFlash 2": "tab:red"}
    for name, r in results.items():
        k = np.arange(1, len(r["recall1"]) + 1)
        ax.plot(k, np.array(r["recall1"]) * 100, "-o", color=colors.get(name), label=f"{name} R@1")
        if "recall16" in r:
            ax.plot(k, np.array(r["recall16"]) * 100, "--", color=colors.get(name), alpha=0.6,
                    label=f"{name} R@16")
    ax.set_xlabel("block row k (draft position)")
    ax.set_ylabel("recall given correct prefix (%)")
    ax.set_title("Per-position recall on HumanEval (SmolLM2-135M target, b=8)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--no-conv-run", required=True, type=Path)
    p.add_argument("--conv-run", required=True, type=Path)
    p.add_argument("--eval-store", required=True, type=Path)
    p.add_argument("--seqs", type=int, default=0, help="evaluate on the first N (0: all)")
    p.add_argument("--out", type=Path, default=Path("docs"))
    p.add_argument("--skip-timing", action="store_true")
    a = p.parse_args(argv)
    model, _, _ = loading.load_target(str(assets.smollm2_gguf()), mx.float32)
    adapter = TargetAdapter(model)
    store = D.FeatureStore(a.eval_store)
    seqs = list(range(len(store)))[: a.seqs or None]
    runs = {"no_conv": load_run(a.no_conv_run), "conv": load_run(a.conv_run)}
    offline = {}
    for key, drafter in runs.items():
        t = time.perf_counter()
        res = offline_eval(drafter, adapter, store, seqs)
        res["seconds"] = time.perf_counter() - t
        offline[key] = res
        print(key, json.dumps({k: v for k, v in res.items() if not isinstance(v, list)}),
              file=sys.stderr, flush=True)
    results = {}
    for name, key, sel in VARIANTS:
        r = offline[key]
        results[name] = {
            "tau_greedy": r["tau_selector"] if sel else r["tau_argmax"],
            "tau_t1_estimate": r["tau_t1_selector"] if sel else r["tau_t1_argmax"],
            "recall1": r["selector_recall1"] if sel else r["recall1"],
            "recall16": r["recall16"],
        }
    timing = {}
    if not a.skip_timing:
        drafters = {"DFlash": without_selector(runs["no_conv"]), "+ selector": runs["no_conv"],
                    "+ conv": without_selector(runs["conv"]), "DFlash 2": runs["conv"]}
        timing = cycle_times(drafters, adapter)
        base = timing["DFlash/greedy"] + timing["verify"]
        for name in drafters:
            results[name]["draft_ms_greedy"] = timing[f"{name}/greedy"]
            results[name]["draft_ms_t1"] = timing[f"{name}/t1"]
            results[name]["cycle_overhead_greedy"] = \
                (timing[f"{name}/greedy"] - timing["DFlash/greedy"]) / base
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "ablation.json").write_text(json.dumps(
        {"variants": results, "offline": offline, "timing_ms": timing,
         "eval_sequences": len(seqs), "eval_anchors": offline["conv"]["anchors"]}, indent=1))
    plot(results, a.out / "recall.png")
    print("| variant | tau greedy | tau T=1 (est.) | R@1 k=1..7 | R@16 k=1..7 |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['tau_greedy']:.3f} | {r['tau_t1_estimate']:.3f} | "
              f"{' '.join(f'{x * 100:.0f}' for x in r['recall1'])} | "
              f"{' '.join(f'{x * 100:.0f}' for x in r['recall16'])} |")
    return 0


if __name__ == "__main__":
    dflash2_mlx.use_fast_blas()      # MLX's float32 matmuls on MKL / OpenBLAS (Linux)
    raise SystemExit(main())
