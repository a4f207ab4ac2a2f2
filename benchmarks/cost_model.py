"""The context-aware cost model against measured forwards, at short and long contexts.

    python benchmarks/cost_model.py [--model M --draft D] [--contexts 100,1024,4096,8192]
                                    [--widths 1,2,4,8,16] [--real-up-to 1024] [--reps 3]

Calibrates (`costs.measure_costs`, timed: the calibration's own cost), then at each context
builds the target's cache by a real prefill (contexts up to `--real-up-to`; longer ones take
minutes here) or by `costs.grow_cache` (random keys and values), the drafter's from the
prefill's features (or random ones), and times the verify of each width and the drafter's
pass, round-robin, against what the model predicts. Prints ms measured / predicted and their
ratio per context and width (verify), and the drafter's pass per context (point 4 of issue 21:
how the drafter's cost grows with the context). Only ratios measured in one run mean anything
on a shared machine; the load average is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import mlx.core as mx

import dflash2_mlx
from dflash2_mlx.costs import grow_cache, measure_costs
from dflash2_mlx.sampling import Sampling


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--contexts", default="100,1024,4096,8192")
    ap.add_argument("--widths", default="1,2,4,8,16")
    ap.add_argument("--real-up-to", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    pipe = dflash2_mlx.load(a.model, a.draft)
    target, drafter = pipe.adapter, pipe.drafter
    widths = [int(w) for w in a.widths.split(",")]
    print(f"load average before: {os.getloadavg()}")
    tic = time.perf_counter()
    model = measure_costs(pipe, pipe.max_width(True))
    print(f"calibration: {time.perf_counter() - tic:.1f} s; verify slope (per row, per "
          f"forward) {model.verify_slope[0] * 1e9:.1f} / {model.verify_slope[1] * 1e9:.1f} "
          f"ns per token, draft slope {model.draft_slope[0] * 1e9:.1f} / "
          f"{model.draft_slope[1] * 1e9:.1f}")
    greedy, block = Sampling(), drafter.args.block_size
    print("| context | cache | " + " | ".join(f"verify w={w} ms (model)" for w in widths)
          + f" | draft w={block} ms (model) |")
    print("|---" * (len(widths) + 3) + "|")
    for n in [int(x) for x in a.contexts.split(",")]:
        real = n <= a.real_up_to
        start = n if real else min(n, 128)
        ids = mx.array([[(17 * i + 3) % target.vocab_size for i in range(start)]], mx.uint32)
        cache, dcache = target.make_cache(), drafter.make_cache()
        _, feats = target.forward(ids, cache)
        if not real:
            grow_cache(cache, n - start)
            feats = mx.concatenate([feats, mx.random.normal(
                (1, n - start, feats.shape[-1])).astype(feats.dtype)], axis=1)
        anchor = ids[:, -1:]
        mx.eval(drafter.propose(target, anchor, feats, dcache, 2, greedy,
                                mx.random.key(0)).tokens)
        v = {w: [] for w in widths}
        d = []
        for rep in range(a.reps + 1):
            for w in widths:
                snap = target.snapshot(cache)
                t = time.perf_counter()
                mx.eval(target.forward(mx.repeat(anchor, w, axis=1), cache))
                if rep:
                    v[w].append(time.perf_counter() - t)
                snap.rollback(0, w)
            t = time.perf_counter()
            mx.eval(drafter.propose(target, anchor, feats[:, :0], dcache, block, greedy,
                                    mx.random.key(0)).tokens)
            if rep:
                d.append(time.perf_counter() - t)
        cells = [f"{1e3 * statistics.median(v[w]):.0f} ({1e3 * model.verify(w, n):.0f})"
                 for w in widths]
        print(f"| {n} | {'prefill' if real else 'grown'} | " + " | ".join(cells) +
              f" | {1e3 * statistics.median(d):.0f} ({1e3 * model.draft(block, n):.0f}) |",
              flush=True)
        del cache, dcache
        mx.clear_cache()
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
