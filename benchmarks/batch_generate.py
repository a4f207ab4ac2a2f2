"""Aggregate tok/s of `Pipeline.generate_batch` at several batch sizes, against one-at-a-time
`generate`, the batch with speculation off, and mlx-lm's `batch_generate`, on the same weights
(the embedded SmolLM2 pair, greedy), code and chat prompts, with texts compared.

    python benchmarks/batch_generate.py --batch 1,2,4,8 --max-tokens 96 --out docs/bench/batch.json

Also, with --step-costs, what one batched verify step costs against B separate forwards (the
batch cache's masks and holes included), per batch size and rows per sequence. Each system runs
the same prompts in turn, so a shared machine's load swings hit them alike; the load average is
reported beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import mlx.core as mx

import dflash2_mlx
from dflash2_mlx.cache.batch import batch_cache
from dflash2_mlx.bench.prompt_sets import agent_prompts, chat_prompts


def prompts_for(pipe, b: int) -> list[list[int]]:
    """b prompts alternating code (agent edits) and chat, chat-templated ids."""
    code, chat = agent_prompts((b + 1) // 2), chat_prompts(b // 2)
    mixed = [p for pair in zip(code, chat) for p in pair] + code[len(chat):]
    return [pipe.encode(p) for p in mixed[:b]]


def timed(fn):
    tic = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - tic


def systems(pipe, ids: list[list[int]], n: int, block_size) -> dict:
    """name -> (texts, generated tokens, seconds)."""
    from mlx_lm.generate import batch_generate

    out = {}
    gens, s = timed(lambda: pipe.generate_batch(ids, max_tokens=n, block_size=block_size))
    out["batch"] = ([g.text for g in gens], sum(len(g.tokens) for g in gens), s)
    gens, s = timed(lambda: pipe.generate_batch(ids, max_tokens=n, block_size=1,
                                                lookup=False))
    out["batch-plain"] = ([g.text for g in gens], sum(len(g.tokens) for g in gens), s)
    gens, s = timed(lambda: [pipe.generate(p, max_tokens=n, block_size=block_size)
                             for p in ids])
    out["one-at-a-time"] = ([g.text for g in gens], sum(len(g.tokens) for g in gens), s)
    res, s = timed(lambda: batch_generate(pipe.target, pipe.tokenizer, ids, max_tokens=n,
                                          return_token_ids=True))
    out["mlx-lm"] = (list(res.texts), sum(len(t) for t in res.token_ids), s)
    return out


def step_costs(pipe, batches, widths, context: int = 128, reps: int = 5) -> list[dict]:
    """Seconds of one verify of B sequences x T rows: batched (one forward, the ragged cache)
    against B forwards of one sequence each, after `context`-token prompts."""
    target, rows = pipe.adapter, []
    ids = mx.array([[(17 * i) % target.vocab_size for i in range(context)]], dtype=mx.uint32)
    single = target.make_cache()
    mx.eval(target.forward(ids, single))
    for b in batches:
        batch = batch_cache(single)
        for _ in range(b - 1):
            for c, r in zip(batch, batch_cache(single)):
                c.extend(r)
        for t in widths:
            x = mx.repeat(ids[:, -1:], t, axis=1)
            one, many = [], []
            for rep in range(reps + 1):
                tic = time.perf_counter()
                mx.eval(target.forward(mx.repeat(x, b, axis=0), batch))
                for c in batch:
                    c.commit([1] * b)
                mid = time.perf_counter()
                for _ in range(b):
                    mx.eval(target.forward(x, single))
                    for c in single:
                        c.trim(t)
                end = time.perf_counter()
                if rep:
                    one.append(mid - tic)
                    many.append(end - mid)
            rows.append({"B": b, "T": t, "batched_s": statistics.median(one),
                         "separate_s": statistics.median(many)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="1,2,4,8", help="batch sizes, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--block-size", default="auto")
    ap.add_argument("--step-costs", action="store_true")
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = ap.parse_args()
    pipe = dflash2_mlx.load()
    block = args.block_size if args.block_size == "auto" else int(args.block_size)
    sizes = [int(b) for b in args.batch.split(",")]
    pipe.generate("warm up", max_tokens=4)
    report = {"max_tokens": args.max_tokens, "block_size": args.block_size, "runs": []}
    print(f"{'B':>3} {'system':>14} {'tokens':>7} {'s':>7} {'tok/s':>7} {'vs mlx-lm':>9}  "
          "texts = one-at-a-time / mlx-lm   load")
    for b in sizes:
        ids = prompts_for(pipe, b)
        res = systems(pipe, ids, args.max_tokens, block)
        load = os.getloadavg()[0]
        ref_rate = res["mlx-lm"][1] / res["mlx-lm"][2]
        for name, (texts, tokens, s) in res.items():
            same = (sum(a == r for a, r in zip(texts, res["one-at-a-time"][0])),
                    sum(a == r for a, r in zip(texts, res["mlx-lm"][0])))
            print(f"{b:>3} {name:>14} {tokens:>7} {s:>7.2f} {tokens / s:>7.1f} "
                  f"{tokens / s / ref_rate:>8.2f}x  {same[0]}/{b}, {same[1]}/{b}"
                  f"   {load:.1f}")
            report["runs"].append({"B": b, "system": name, "tokens": tokens, "seconds": s,
                                   "tok_s": tokens / s, "same_as_alone": same[0],
                                   "same_as_mlx_lm": same[1], "load": load})
    if args.step_costs:
        report["step_costs"] = step_costs(pipe, sizes, (1, 4, 8))
        print(f"\n{'B':>3} {'T':>3} {'batched ms':>11} {'B separate ms':>14} {'ratio':>6}")
        for r in report["step_costs"]:
            print(f"{r['B']:>3} {r['T']:>3} {1e3 * r['batched_s']:>11.1f} "
                  f"{1e3 * r['separate_s']:>14.1f} {r['separate_s'] / r['batched_s']:>6.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
