"""What the lookup costs per cycle as the context grows: `LookupIndex.propose` plus `extend`
with a cycle's new tokens, at 1k, 10k and 100k tokens of context, against the time of a
draft-verify cycle of the embedded default (its calibrated width-16 verify, or --cycle-ms).

    python benchmarks/lookup_cost.py [--cycles 2000] [--cycle-ms MS]

The context is real text: the standard library's own source, tokenized by SmolLM2's tokenizer
(repeated when shorter than asked), so n-grams recur as they do in code.
"""

from __future__ import annotations

import argparse
import inspect
import random
import statistics
import time

from dflash2_mlx.decode.lookup import LookupIndex


def context_tokens(tokenizer, n: int) -> list[int]:
    import json
    import textwrap

    text = inspect.getsource(json) + inspect.getsource(textwrap) + inspect.getsource(random)
    ids = tokenizer.encode(text)
    return (ids * (n // len(ids) + 1))[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=2000)
    ap.add_argument("--cycle-ms", type=float, default=None,
                    help="cycle time to compare with (default: the calibrated width-16 verify)")
    a = ap.parse_args()

    import dflash2_mlx
    from dflash2_mlx.policy.calibration import load_or_measure_costs

    pipe = dflash2_mlx.load()
    cycle_ms = a.cycle_ms or 1e3 * load_or_measure_costs(pipe, pipe.max_width(True)).cycle(
        16, "lookup")
    rng = random.Random(0)
    print(f"cycle (width-16 verify of the embedded default): {cycle_ms:.1f} ms")
    print("| context tokens | index build s | lookup per cycle, median us | p99 us | "
          "share of a cycle |\n|---|---|---|---|---|")
    for n in (1_000, 10_000, 100_000):
        ids = context_tokens(pipe.tokenizer, n + a.cycles * 8)
        tic = time.perf_counter()
        index = LookupIndex(tokens=ids[:n])
        build = time.perf_counter() - tic
        pos, times = n, []
        for _ in range(a.cycles):
            t0 = time.perf_counter()
            index.propose(15)
            accepted = rng.randrange(0, 8)                  # what a cycle commits: a + 1
            index.extend(ids[pos : pos + accepted + 1])
            times.append(time.perf_counter() - t0)
            pos += accepted + 1
        us = sorted(t * 1e6 for t in times)
        med, p99 = statistics.median(us), us[int(0.99 * len(us))]
        print(f"| {n:,} | {build:.2f} | {med:.1f} | {p99:.1f} | {med / 1e3 / cycle_ms:.4%} |")


if __name__ == "__main__":
    main()
