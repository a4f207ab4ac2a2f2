"""What leaving costs a batch: B agent prompts decode plainly together and leave one by one (the
i-th after 10 + 3 i tokens), so a sequence leaves every third step; prints each decode step's
seconds as `Engine.history` times them for the policies (the leave itself is not in
them), and the decode loop's wall time.

    python benchmarks/leave_cost.py --clients 16 --repeats 2

Embedded SmolLM2 target, greedy, every sequence `FixedWidth(1)` (all steps launched ahead).
Before leaves kept the launch chain and moved only the leaver's place (docs/batching.md,
"Leave"), the step after a leave took ~2.5x a steady one.
"""

from __future__ import annotations

import argparse
import time

import dflash2_mlx  # first: it picks the BLAS before MLX loads
from dflash2_mlx.policy.adaptive import FixedWidth
from dflash2_mlx.decode.engine import Request
from dflash2_mlx.bench.prompt_sets import agent_prompts
from dflash2_mlx.decode.sampling import Sampling


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", action="store_true", help="print every decode step")
    a = ap.parse_args()
    pipe = dflash2_mlx.load()
    ids = [pipe.encode(p) for p in agent_prompts(a.clients)]
    print(f"prompt tokens: {[len(p) for p in ids]}")
    for rep in range(a.repeats):
        engine = pipe.batch_engine()
        for i, p in enumerate(ids):
            engine.add(Request(list(p), 10 + 3 * i, Sampling(), FixedWidth(1)))
        engine.step()                             # prefill, join, the first decode step
        tic, after = time.perf_counter(), []
        while engine.running:
            left = any(e.finish for e in engine.step())
            if a.steps:
                b, _, s = engine.history[-1]
                print(f"  B = {b:2d}: {s * 1e3:6.0f} ms{'  (a sequence left)' if left else ''}")
            if left and engine.running:
                after.append(len(engine.history))      # the next step follows a leave
        wall = time.perf_counter() - tic
        steps = [s for _, _, s in engine.history[1:]]
        follow = [engine.history[i][2] / engine.history[i - 1][2]
                  for i in after if i < len(engine.history)]
        print(f"B = {a.clients}, run {rep + 1}: {len(steps)} decode steps, loop {wall:.2f} s; "
              f"the step after a leave / the one before it: median "
              f"{sorted(follow)[len(follow) // 2]:.2f}", flush=True)


if __name__ == "__main__":
    main()
