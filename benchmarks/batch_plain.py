"""The batched plain step against mlx-lm's `BatchGenerator`, in one process, on the same weights:
ms per decode step (median), prefill seconds for the B prompts, tok/s, and where our step's
time goes.

    nice -n 19 python benchmarks/batch_plain.py --kind code,agent --clients 8,16 --max-tokens 32

Embedded SmolLM2 target, greedy, no stop tokens (every sequence makes max_tokens). `ours`:
`Pipeline.batch_engine()` with every sequence plain (`FixedWidth(1)`, no lookup), all prompts
added at once and the first step prefilling them all (`prefill_budget=None`). `mlx-lm`:
`mlx_lm.generate.BatchGenerator` on the target's own mlx-lm model object (`pipe.target`).
kind: `code` (HumanEval prompts, ~150 tokens) or `agent` (benchmarks/batch_policy.py's
agent first turns, ~1k tokens). Our breakdown is `BatchEngine.timings` (seconds per section
over the decode steps). Only ratios in one run mean anything on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import dflash2_mlx
from dflash2_mlx.adaptive import FixedWidth
from dflash2_mlx.batch import Request
from dflash2_mlx.sampling import Sampling

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch_policy import prompts  # noqa: E402


def ours(pipe, ids: list[list[int]], max_tokens: int) -> dict:
    engine = pipe.batch_engine()
    engine.timings = {}
    for p in ids:
        engine.add(Request(list(p), max_tokens, Sampling(), FixedWidth(1)))
    out: dict[int, list[int]] = {}
    steps, tic = [], time.perf_counter()
    prefill = None
    while engine.running or engine.waiting:
        t = time.perf_counter()
        joining = engine.waiting > 0
        for ev in engine.step():
            out.setdefault(ev.id, []).extend(ev.tokens)
        if not joining:
            steps.append(time.perf_counter() - t)
        elif prefill is None:
            prefill = sum(s.prefill_s for s in engine.stats.values())
    wall = time.perf_counter() - tic
    tokens = sum(len(v) for v in out.values())
    n = max(len(steps), 1)
    return {"step_ms": 1e3 * statistics.median(steps), "prefill_s": prefill,
            "tok_s": tokens / wall, "decode_tok_s": (tokens - len(ids)) / sum(steps) if steps
            else None, "steps": len(steps),
            "breakdown_ms": {k: round(1e3 * v / n, 2) for k, v in engine.timings.items()},
            "texts": [out[i] for i in sorted(out)]}


def mlx_lm(pipe, ids: list[list[int]], max_tokens: int) -> dict:
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(pipe.target, max_tokens=max_tokens, stop_tokens=None,
                         prefill_step_size=pipe.prefill_step_size)
    uids = gen.insert([list(p) for p in ids], [max_tokens] * len(ids))
    out: dict[int, list[int]] = {u: [] for u in uids}
    steps, tic, prefill = [], time.perf_counter(), 0.0
    live = set(uids)
    while live:
        t = time.perf_counter()
        prompt_rs, gen_rs = gen.next()
        dt = time.perf_counter() - t
        for r in gen_rs:
            out[r.uid].append(r.token)
            if r.finish_reason is not None:
                live.discard(r.uid)
        if prompt_rs:
            prefill += dt
        else:
            steps.append(dt)
    wall = time.perf_counter() - tic
    gen.close()
    tokens = sum(len(v) for v in out.values())
    return {"step_ms": 1e3 * statistics.median(steps), "prefill_s": prefill,
            "tok_s": tokens / wall, "decode_tok_s": (tokens - len(ids)) / sum(steps) if steps
            else None, "steps": len(steps), "texts": [out[u] for u in uids]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", default="code,agent")
    ap.add_argument("--clients", default="8,16")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--order", default="mlx-lm,ours", help="which runs first (warm-up: both "
                    "run once on two prompts before the measured runs)")
    a = ap.parse_args()
    pipe = dflash2_mlx.load()
    systems = {"ours": ours, "mlx-lm": mlx_lm}
    for name in a.order.split(","):                  # warm both (graphs, allocator)
        systems[name](pipe, prompts(pipe, "code", 2), 4)
    for kind in a.kind.split(","):
        for n in [int(x) for x in a.clients.split(",")]:
            ids = prompts(pipe, kind, n)
            res = {name: systems[name](pipe, ids, a.max_tokens) for name in a.order.split(",")}
            o, m = res["ours"], res["mlx-lm"]
            print(f"{kind} x {n} (mean prompt {sum(map(len, ids)) / n:.0f} tokens, "
                  f"{a.max_tokens} new; load {os.getloadavg()[0]:.1f}):", flush=True)
            for name, r in res.items():
                print(f"  {name:7s} step {r['step_ms']:7.1f} ms  prefill {r['prefill_s']:6.2f} s"
                      f"  tok/s {r['tok_s']:6.1f}  decode tok/s {r['decode_tok_s']:6.1f}"
                      f"  ({r['steps']} steps)")
            print(f"  ours / mlx-lm: step {m['step_ms'] / o['step_ms']:.3f}x faster, prefill "
                  f"{m['prefill_s'] / o['prefill_s']:.3f}x, tok/s {o['tok_s'] / m['tok_s']:.3f}x,"
                  f" decode tok/s {o['decode_tok_s'] / m['decode_tok_s']:.3f}x; texts "
                  f"{'identical' if o['texts'] == m['texts'] else 'DIFFER'}")
            print(f"  ours per step (ms): {o['breakdown_ms']}", flush=True)


if __name__ == "__main__":
    main()
