"""Plain decoding under `auto` against `--block-size 1`: ms per step side by side.

    python benchmarks/plain_steps.py [--model M --draft D] [--prompt TEXT] [--tokens 64]
                                     [--reps 3] [--context 0]

The prompt is prefilled once (`--context N` pads it with a deterministic code text to about N
tokens); every run starts from a copy of that state (`DecodeState.copy()`), the systems
alternating run by run: b=1, `auto --no-lookup`, `auto` (lookup on). Prints per system the
median ms per step (decode seconds / steps), its ratio to b=1, the median of the paired
decode tok/s ratios to b=1 (what a drafting cycle's extra tokens are worth), how many steps
drafted, and the policy's own Python cost per cycle (`choose` + `next_plain` + `update`, timed alone).
Greedy outputs must be identical. Only ratios measured in one run mean anything on a shared
machine; the load average is printed.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import time

import dflash2_mlx
from dflash2_mlx.policy.adaptive import DRAFTER, PLAIN
from dflash2_mlx.decode.state import DecodeState


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--prompt", default="What are three tips for sleeping better?")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--context", type=int, default=0)
    a = ap.parse_args()
    pipe = dflash2_mlx.load(a.model, a.draft)
    prompt = a.prompt
    if a.context:
        text = inspect.getsource(inspect)
        prompt = f"```python\n{text[: 4 * a.context]}\n```\n\n{a.prompt}"
    ids = pipe.encode(prompt)
    policy = pipe.width_policy()
    state = DecodeState.new(pipe.adapter, pipe.drafter)
    tic = time.perf_counter()
    pipe.generate(ids, max_tokens=1, block_size=1, state=state)
    print(f"{len(ids)} prompt tokens, prefill {time.perf_counter() - tic:.1f} s; load average "
          f"{os.getloadavg()}")
    systems = {"b=1": dict(block_size=1), "auto --no-lookup": dict(block_size="auto",
                                                                    lookup=False),
               "auto": dict(block_size="auto", lookup=True)}
    ms, drafted, outs = {k: [] for k in systems}, {k: 0 for k in systems}, {}
    tps = {k: [] for k in systems}
    for _ in range(a.reps):
        for name, kw in systems.items():
            g = pipe.generate(ids, max_tokens=a.tokens, state=state.copy(), **kw)
            ms[name].append(1e3 * g.stats.decode_s / max(len(g.stats.steps), 1))
            tps[name].append(g.stats.decode_tps)
            drafted[name] += g.stats.cycles
            outs.setdefault(name, g.tokens)
    base = statistics.median(ms["b=1"])
    print("| system | ms/step (median of runs) | vs b=1 | decode tok/s vs b=1 (median of "
          "paired runs) | drafting cycles (all runs) |")
    print("|---|---|---|---|---|")
    for name in systems:
        m = statistics.median(ms[name])
        speed = statistics.median(t / b for t, b in zip(tps[name], tps["b=1"]))
        print(f"| {name} | {m:.1f} | {m / base:.3f}x | {speed:.3f}x | {drafted[name]} |")
    same = all(o == outs["b=1"] for o in outs.values())
    print(f"greedy outputs identical: {same}")
    # the policy's own cost per cycle, with nothing else running
    avail, n = {DRAFTER: pipe.drafter.args.block_size}, 2000
    # an older commit's policy (run through PYTHONPATH) takes no context
    ctx = (lambda i: (len(ids) + i,)) if "context" in inspect.signature(
        policy.choose).parameters else (lambda i: ())
    tic = time.perf_counter()
    for i in range(n):
        s, w = policy.choose(avail, 0, *ctx(i))
        policy.next_plain(avail, *ctx(i + 1))
        policy.update(PLAIN if w == 1 else s, w, 0, None, 0, *ctx(i))
    print(f"policy choose + next_plain + update: {1e6 * (time.perf_counter() - tic) / n:.0f} "
          f"us per cycle; load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
