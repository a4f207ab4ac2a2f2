"""The drafter's pass cost against the context length (issue 21, point 4), beside a plain
target step at the same context, and with a bounded attention window over the context.

    python benchmarks/drafter_context.py [--model M --draft D] [--contexts 128,1024,2048,4096,8192]
                                         [--window 1024] [--reps 3]

At each context the target's cache is grown with random keys and values and the drafter's
context with random target features (`calibration.grow_cache`: attention's cost does not depend on
the values), fed in chunks as decoding would; `--window` gives the drafter's context caches
that bound (`drafter.ContextCache(window)`: older rows dropped), which measures the cost only,
not what a window does to acceptance (the shipped drafter was trained with full context).
Prints per context the median ms of a plain target step, of the drafter's pass of its block
(full context, and windowed), and the drafter's pass over the plain step. One run on a shared
machine: only ratios within a row mean much; the load average is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import mlx.core as mx

import dflash2_mlx
from dflash2_mlx.model.drafter import ContextCache
from dflash2_mlx.policy.calibration import grow_cache
from dflash2_mlx.decode.sampling import Sampling


def _drafter_ms(pipe, feats, anchor, window, reps):
    """Median ms of the drafter's block pass after reading `feats` [1, n, F] in chunks."""
    target, drafter = pipe.adapter, pipe.drafter
    greedy, block = Sampling(), drafter.args.block_size
    dcache = drafter.make_cache() if window is None else \
        [ContextCache(window) for _ in drafter.layers]
    for s in range(0, feats.shape[1], 512):
        mx.eval(drafter.propose(target, anchor, feats[:, s:s + 512], dcache, 2, greedy,
                                mx.random.key(0)).tokens)
    times = []
    for rep in range(reps + 1):
        t = time.perf_counter()
        mx.eval(drafter.propose(target, anchor, feats[:, :0], dcache, block, greedy,
                                mx.random.key(0)).tokens)
        if rep:
            times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--contexts", default="128,1024,2048,4096,8192")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    pipe = dflash2_mlx.load(a.model, a.draft)
    target = pipe.adapter
    print(f"load average before: {os.getloadavg()}")
    print(f"| context | plain step ms | drafter pass ms | windowed ({a.window}) ms | "
          f"drafter / plain | windowed / plain |")
    print("|---|---|---|---|---|---|")
    for n in [int(x) for x in a.contexts.split(",")]:
        start = min(n, 128)
        ids = mx.array([[(17 * i + 3) % target.vocab_size for i in range(start)]], mx.uint32)
        cache = target.make_cache()
        _, feats = target.forward(ids, cache)
        grow_cache(cache, n - start)
        feats = mx.concatenate([feats, mx.random.normal(
            (1, n - start, feats.shape[-1])).astype(feats.dtype)], axis=1)
        mx.eval(feats)
        anchor = ids[:, -1:]
        plain = []
        for rep in range(a.reps + 1):
            snap = target.snapshot(cache)
            t = time.perf_counter()
            mx.eval(target.forward(anchor, cache))
            if rep:
                plain.append(1e3 * (time.perf_counter() - t))
            snap.rollback(0, 1)
        p = statistics.median(plain)
        full = _drafter_ms(pipe, feats, anchor, None, a.reps)
        win = _drafter_ms(pipe, feats, anchor, a.window, a.reps)
        print(f"| {n} | {p:.1f} | {full:.1f} | {win:.1f} | {full / p:.2f} | {win / p:.2f} |",
              flush=True)
        del cache
        mx.clear_cache()
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
