"""The batched plain step against mlx-lm's `BatchGenerator`, in one process, on the same weights:
ms per decode step (median), prefill seconds for the B prompts, tok/s, and where our step's
time goes.

    nice -n 19 python benchmarks/batch_plain.py --kind code,agent --clients 8,16 --max-tokens 32 \
        [--baseline old_batch.py]

Embedded SmolLM2 target, greedy, no stop tokens (every sequence makes max_tokens). `ours`:
`Pipeline.batch_engine()` with every sequence plain (`FixedWidth(1)`, no lookup), all prompts
added at once and the first step prefilling them all (`prefill_budget=None`). `mlx-lm`:
`mlx_lm.generate.BatchGenerator` on the target's own mlx-lm model object (`pipe.target`),
which prefills 8 prompts per batched forward. The two run interleaved, 6 steps of each in
turn (then a synchronize, timed as its own), so that the machine's load falls on both alike;
both warm up on two prompts first.
kind: `code` (HumanEval prompts, ~150 tokens) or `agent` (benchmarks/batch_policy.py's
agent first turns, ~1k tokens). Our breakdown is `Engine.timings` (seconds per section
over the decode steps). Only ratios in one run mean anything on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import dflash2_mlx  # first: it picks the BLAS before MLX loads
import mlx.core as mx
from dflash2_mlx.policy.adaptive import FixedWidth
from dflash2_mlx.decode.engine import Request
from dflash2_mlx.decode.sampling import Sampling

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch_policy import load_baseline, prompts  # noqa: E402


def ours(pipe, ids: list[list[int]], max_tokens: int, out: dict, module=None,
         launch: bool = True):
    """Our engine (or another version's batch.py, `module`), one `step()` per next(): yields
    (seconds, prefilled, tokens) per step. launch: `Engine`'s."""
    if module is None:
        engine, request = pipe.batch_engine(), Request
        engine.launch = launch
        engine.timings = out["timings"] = {}
    else:
        engine = module.Engine(pipe.adapter, pipe.drafter, lookup=pipe.lookup_config,
                               prefill_step_size=pipe.prefill_step_size)
        request = module.Request
    for p in ids:
        engine.add(request(list(p), max_tokens, Sampling(), FixedWidth(1)))
    texts: dict[int, list[int]] = {}
    while engine.running or engine.waiting:
        t = time.perf_counter()
        joining = engine.waiting > 0
        events = engine.step()
        for ev in events:
            texts.setdefault(ev.id, []).extend(ev.tokens)
        yield time.perf_counter() - t, joining, sum(len(ev.tokens) for ev in events)
    out["texts"] = [texts[i] for i in sorted(texts)]


def mlx_lm(pipe, ids: list[list[int]], max_tokens: int, out: dict):
    """mlx-lm's BatchGenerator, one `next()` per next(): as `ours`."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(pipe.target, max_tokens=max_tokens, stop_tokens=None,
                         prefill_step_size=pipe.prefill_step_size)
    uids = gen.insert([list(p) for p in ids], [max_tokens] * len(ids))
    texts: dict[int, list[int]] = {u: [] for u in uids}
    live = set(uids)
    while live:
        t = time.perf_counter()
        prompt_rs, gen_rs = gen.next()
        dt = time.perf_counter() - t
        for r in gen_rs:
            texts[r.uid].append(r.token)
            if r.finish_reason is not None:
                live.discard(r.uid)
        yield dt, bool(prompt_rs), len(gen_rs)
    gen.close()
    out["texts"] = [texts[u] for u in uids]


def ours_sync(pipe, ids: list[list[int]], max_tokens: int, out: dict):
    """Our engine with no step launched ahead."""
    return ours(pipe, ids, max_tokens, out, launch=False)


SYSTEMS = {"ours": ours, "mlx-lm": mlx_lm, "ours-sync": ours_sync}
BASELINE = None    # the module of --baseline, run as the system "baseline"
BLOCK = 6          # steps of one system in a turn (each keeps its launch-ahead within one)


def compare(pipe, ids: list[list[int]], max_tokens: int, order: list[str]) -> dict:
    """Both systems on the same prompts, their steps interleaved (BLOCK of each in turn, so a
    change in the machine's load falls on both) -> per system: median decode step ms, prefill
    seconds (the steps that prefilled), tok/s over all its steps, decode tok/s (the tokens of
    the steps that did not prefill over their seconds), texts."""
    outs = {name: {} for name in order}
    runs = {name: SYSTEMS[name](pipe, ids, max_tokens, outs[name]) if name in SYSTEMS
            else ours(pipe, ids, max_tokens, outs[name], BASELINE) for name in order}
    steps = {name: [] for name in order}
    while runs:
        for name in list(runs):
            try:
                for _ in range(BLOCK):
                    steps[name].append(next(runs[name]))
            except StopIteration:
                del runs[name]
            # what it left in flight is its own time, not the other's
            tic = time.perf_counter()
            mx.synchronize()
            if steps[name]:
                dt, *rest = steps[name][-1]
                steps[name][-1] = (dt + time.perf_counter() - tic, *rest)
    res = {}
    for name in order:
        decode = [(dt, k) for dt, prefilled, k in steps[name] if not prefilled]
        total = sum(dt for dt, _, _ in steps[name])
        tokens = sum(map(len, outs[name]["texts"]))
        decode_s = sum(dt for dt, _ in decode)
        n = max(len(decode), 1)
        res[name] = {"step_ms": 1e3 * statistics.median(dt for dt, _ in decode),
                     "prefill_s": total - decode_s, "tok_s": tokens / total,
                     "decode_tok_s": sum(k for _, k in decode) / decode_s, "steps": len(decode),
                     "texts": outs[name]["texts"],
                     "breakdown_ms": {k: round(1e3 * v / n, 2)
                                      for k, v in outs[name].get("timings", {}).items()}}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", default="code,agent")
    ap.add_argument("--clients", default="8,16")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--order", default="mlx-lm,ours", help="the systems, in the order they "
                    "step in each turn (mlx-lm, ours, ours-sync: ours launching nothing ahead)")
    ap.add_argument("--baseline", type=Path,
                    help="another batch.py, run as the system `baseline` beside the others "
                         "(`git show REV:dflash2_mlx/batch.py > old_batch.py`)")
    a = ap.parse_args()
    global BASELINE
    pipe = dflash2_mlx.load()
    order = a.order.split(",")
    if a.baseline:
        BASELINE = load_baseline(a.baseline)
        order.append("baseline")
    compare(pipe, prompts(pipe, "code", 2), 4, order)      # warm both (graphs, allocator)
    for kind in a.kind.split(","):
        for n in [int(x) for x in a.clients.split(",")]:
            ids = prompts(pipe, kind, n)
            res = compare(pipe, ids, a.max_tokens, order)
            o, m, b = res["ours"], res["mlx-lm"], res.get("baseline")
            print(f"{kind} x {n} (mean prompt {sum(map(len, ids)) / n:.0f} tokens, "
                  f"{a.max_tokens} new; load {os.getloadavg()[0]:.1f}):", flush=True)
            for name, r in res.items():
                print(f"  {name:7s} step {r['step_ms']:7.1f} ms  prefill {r['prefill_s']:6.2f} s"
                      f"  tok/s {r['tok_s']:6.1f}  decode tok/s {r['decode_tok_s']:6.1f}"
                      f"  ({r['steps']} steps)")
            print(f"  ours / mlx-lm: step time {o['step_ms'] / m['step_ms']:.3f}x, prefill time "
                  f"{o['prefill_s'] / m['prefill_s']:.3f}x, tok/s {o['tok_s'] / m['tok_s']:.3f}x,"
                  f" decode tok/s {o['decode_tok_s'] / m['decode_tok_s']:.3f}x; texts "
                  f"{'identical' if o['texts'] == m['texts'] else 'DIFFER'}")
            if b is not None:
                print(f"  ours / baseline: step time {o['step_ms'] / b['step_ms']:.3f}x, "
                      f"tok/s {o['tok_s'] / b['tok_s']:.3f}x, decode tok/s "
                      f"{o['decode_tok_s'] / b['decode_tok_s']:.3f}x; baseline / mlx-lm: "
                      f"decode tok/s {b['decode_tok_s'] / m['decode_tok_s']:.3f}x; texts "
                      f"{'identical' if o['texts'] == b['texts'] else 'DIFFER'}")
            if "ours-sync" in res:
                q = res["ours-sync"]
                print(f"  ours / ours-sync: step time {o['step_ms'] / q['step_ms']:.3f}x, "
                      f"decode tok/s {o['decode_tok_s'] / q['decode_tok_s']:.3f}x; ours-sync /"
                      f" mlx-lm: decode tok/s {q['decode_tok_s'] / m['decode_tok_s']:.3f}x")
            print(f"  ours per step (ms): {o['breakdown_ms']}", flush=True)


if __name__ == "__main__":
    main()
