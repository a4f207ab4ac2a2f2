"""What a join costs the decode steps after it: B HumanEval prompts start in one step, then the
seconds of each of the next steps (a plain batch, launched ahead), as `Engine.history`
times them for the policies.

    python benchmarks/join_cost.py --clients 16 --steps 5 --repeats 2

Embedded SmolLM2 target, greedy, every sequence `FixedWidth(1)`. The first `step()` prefills
all B prompts (`prefill_budget=None`), joins them and decodes once; its decode part is the
first figure. A first plain step that launches the next one waits for both, so ~2x a steady
step is the floor; before the one-copy join (docs/batching.md, "Join") it was ~12x at B = 16.
"""

from __future__ import annotations

import argparse
import statistics
import time

import dflash2_mlx  # first: it picks the BLAS before MLX loads
from dflash2_mlx.policy.adaptive import FixedWidth
from dflash2_mlx.decode.engine import Request
from dflash2_mlx.bench.prompt_sets import humaneval_prompts
from dflash2_mlx.decode.sampling import Sampling


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    pipe = dflash2_mlx.load()
    ids = [pipe.encode(p) for p in humaneval_prompts(a.clients)]
    for rep in range(a.repeats):
        engine = pipe.batch_engine()
        for p in ids:
            engine.add(Request(list(p), a.steps + 4, Sampling(), FixedWidth(1)))
        tic = time.perf_counter()
        engine.step()
        first_call = time.perf_counter() - tic
        for _ in range(a.steps):
            engine.step()
        decode = [s for _, _, s in engine.history]
        print(f"B = {a.clients}, run {rep + 1}: first step() {first_call:.2f} s (prefill, "
              f"join, decode); decode step after the join {decode[0] * 1e3:.0f} ms, the next "
              f"{a.steps}: median {statistics.median(decode[1:]) * 1e3:.0f} ms", flush=True)


if __name__ == "__main__":
    main()
