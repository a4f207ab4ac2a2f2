"""The context-aware cost model against measured forwards, at short and long contexts.

    python benchmarks/cost_model.py [--model M --draft D] [--contexts 100,1024,4096,8192]
                                    [--widths 1,2,4,8,16] [--real-up-to 1024] [--reps 3]
                                    [--slope-contexts 2048/4096/2048,8192]

Calibrates (`calibration.measure_costs`, timed: the calibration's own cost), then at each context
builds the target's cache by a real prefill (contexts up to `--real-up-to`; longer ones take
minutes here) or by `calibration.grow_cache` (random keys and values), the drafter's from the
prefill's features (or random ones), and times the verify of each width and the drafter's
pass, round-robin, against what the model predicts. Prints ms measured / predicted and their
ratio per context and width (verify), and the drafter's pass per context (point 4 of issue 21:
how the drafter's cost grows with the context). Only ratios measured in one run mean anything
on a shared machine; the load average is printed. `--slope-contexts`: the long contexts the
slopes are fitted at, one fit per '/'-separated choice (the first is the package's
`calibration.LONG_CONTEXTS`), each priced against the same measured forwards.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import mlx.core as mx

import dflash2_mlx
from dflash2_mlx.policy.calibration import LONG_CONTEXTS, grow_cache, measure_costs, measure_slopes
from dflash2_mlx.decode.sampling import Sampling


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--contexts", default="100,1024,4096,8192")
    ap.add_argument("--widths", default="1,2,4,8,16")
    ap.add_argument("--real-up-to", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--slope-contexts", default="/".join(
        [",".join(map(str, LONG_CONTEXTS)), "4096", "2048,8192"]))
    a = ap.parse_args()
    pipe = dflash2_mlx.load(a.model, a.draft)
    target, drafter = pipe.adapter, pipe.drafter
    widths = [int(w) for w in a.widths.split(",")]
    print(f"load average before: {os.getloadavg()}")
    tic = time.perf_counter()
    choices = [tuple(int(n) for n in c.split(",")) for c in a.slope_contexts.split("/")]
    model = measure_costs(pipe, pipe.max_width(True), long=choices[0])
    print(f"calibration: {time.perf_counter() - tic:.1f} s")
    models = {choices[0]: model}
    for long in choices[1:]:
        tic = time.perf_counter()
        models[long] = measure_slopes(pipe, model, long)
        print(f"slopes at {long}: {time.perf_counter() - tic:.1f} s")
    for long, m in models.items():
        print(f"slopes at {long}: verify (per row, per forward) {m.verify_slope[0] * 1e9:.1f}"
              f" / {m.verify_slope[1] * 1e9:.1f} ns per token, draft "
              f"{m.draft_slope[0] * 1e9:.1f} / {m.draft_slope[1] * 1e9:.1f}")
    greedy, block = Sampling(), drafter.args.block_size
    print("| context | cache | slopes at | "
          + " | ".join(f"verify w={w} ms (model)" for w in widths)
          + f" | draft w={block} ms (model) |")
    print("|---" * (len(widths) + 4) + "|")
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
        for i, (long, m) in enumerate(models.items()):
            cells = [f"{1e3 * statistics.median(v[w]):.0f} ({1e3 * m.verify(w, n):.0f})"
                     for w in widths]
            print(f"| {n} | {'prefill' if real else 'grown'} | {'/'.join(map(str, long))} | "
                  + " | ".join(cells) + f" | {1e3 * statistics.median(d):.0f} "
                  f"({1e3 * m.draft(block, n):.0f}) |", flush=True)
        del cache, dcache
        mx.clear_cache()
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
