"""4-bit (and 8-bit) drafter against the unquantized one: tau and ms per cycle, side by side.

One target (the embedded SmolLM2-135M-Instruct, float32 on CPU), one drafter checkpoint loaded
once per precision; every prompt runs every precision in turn (alternating, `--rounds` times),
greedy, same block size. Reported per precision: tau, ms per draft-verify cycle (decode time /
cycles, medians over runs), ms per drafter pass alone (steady state: the block plus one new
context row, after a 256-row context), and how often its greedy proposals equal the
unquantized drafter's on the same context.

    python benchmarks/bench_draft_quant.py [--drafter DIR] [--block-size 8] [--max-tokens 96]

Without --drafter a random DFlash 2 drafter shaped for SmolLM2 is written to a temporary
folder (its tau is ~1: the cycle-time columns are meaningful, the tau column is not).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import dflash2_mlx
import mlx.core as mx

from dflash2_mlx.loading.checkpoint.assets import smollm2_gguf
from dflash2_mlx.loading.checkpoint.checkpoint import load_drafter, save_drafter
from dflash2_mlx.pipeline import Pipeline
from dflash2_mlx.decode.sampling import Sampling
from dflash2_mlx.testing import random_drafter, smollm2_drafter_args

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain what a hash table is in two sentences.",
    "Write a function that checks whether a string is a palindrome.",
    "def quicksort(items):\n    \"\"\"Sort a list of numbers.\"\"\"\n",
]
VARIANTS = {"unquantized": None, "8-bit g64": 8, "4-bit g64": 4}


def random_smollm2_drafter(folder: Path, layers: int) -> Path:
    args = smollm2_drafter_args(layers, selector_rank=256)
    return save_drafter(random_drafter(args, seed=0), folder)


def draft_pass(pipe: Pipeline, feats, anchor, width: int, reps: int = 7):
    """-> (median ms of one steady-state drafter pass, greedy proposal ids of all passes).

    The drafter first reads all of `feats` [1, S, F] (as after a prefill); each timed pass then
    reads one new context row, as a cycle that accepted nothing would."""
    cache = pipe.drafter.make_cache()
    first = pipe.drafter.propose(pipe.adapter, anchor, feats[:, :-reps], cache, width,
                                 Sampling(), mx.random.key(0))
    mx.eval(first.tokens)
    times, tokens = [], first.tokens[0].tolist()
    for i in range(reps, 0, -1):
        row = feats[:, feats.shape[1] - i:][:, :1]
        tic = time.perf_counter()
        prop = pipe.drafter.propose(pipe.adapter, anchor, row, cache, width, Sampling(),
                                    mx.random.key(0))
        mx.eval(prop.tokens)
        times.append(time.perf_counter() - tic)
        tokens += prop.tokens[0].tolist()
    return 1000 * statistics.median(times), tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", type=Path)
    ap.add_argument("--layers", type=int, default=2, help="layers of the random drafter")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    opts = ap.parse_args()

    tmp = tempfile.TemporaryDirectory()
    folder = opts.drafter or random_smollm2_drafter(Path(tmp.name), opts.layers)
    base = dflash2_mlx.load(str(smollm2_gguf()))                  # float32 target on CPU
    adapter = base.adapter
    pipes = {}
    for name, bits in VARIANTS.items():
        drafter = load_drafter(folder, hidden_size=adapter.hidden_size,
                               vocab_size=adapter.vocab_size, num_layers=adapter.num_layers,
                               dtype=mx.float32, bits=bits, group_size=64)
        pipes[name] = Pipeline(base.target, base.tokenizer, drafter)
    print(f"drafter {'(random) ' if opts.drafter is None else ''}{folder}: "
          f"{pipes['unquantized'].drafter.args.num_hidden_layers} layers, block size "
          f"{opts.block_size}, {opts.max_tokens} tokens, {mx.default_device()}")

    taus = {n: [] for n in VARIANTS}
    cycle_ms = {n: [] for n in VARIANTS}
    outputs = {}
    for _ in range(opts.rounds):
        for prompt in PROMPTS:
            ids = base.encode(prompt)
            for name, pipe in pipes.items():
                gen = pipe.generate(ids, max_tokens=opts.max_tokens, block_size=opts.block_size)
                outputs.setdefault(prompt, gen.tokens)
                if gen.tokens != outputs[prompt]:
                    raise SystemExit(f"{name}: greedy output differs on {prompt!r}")
                taus[name].append(gen.stats.tau)
                cycle_ms[name].append(1000 * gen.stats.decode_s / gen.stats.cycles)

    # The drafter alone, on the same 256-row context, and its agreement with unquantized.
    ctx_ids = sum((base.encode(p) for p in PROMPTS), [])
    ctx_ids = (ctx_ids * (256 // len(ctx_ids) + 1))[:257]
    probe = pipes["unquantized"].adapter
    _, feats = probe.forward(mx.array([ctx_ids[:-1]]), probe.make_cache())
    anchor = mx.array([[ctx_ids[-1]]], dtype=mx.uint32)
    pass_ms, proposals = {}, {}
    for name, pipe in pipes.items():
        pass_ms[name], proposals[name] = draft_pass(pipe, feats, anchor, opts.block_size)
    agree = {}
    for name in VARIANTS:
        a, b = proposals[name], proposals["unquantized"]
        agree[name] = sum(x == y for x, y in zip(a, b, strict=True)) / len(b)

    print("\n| drafter | tau | ms / cycle | ms / drafter pass | proposals = unquantized |")
    print("|---|---|---|---|---|")
    for name in VARIANTS:
        print(f"| {name} | {statistics.mean(taus[name]):.2f} | "
              f"{statistics.median(cycle_ms[name]):.1f} | {pass_ms[name]:.1f} | "
              f"{100 * agree[name]:.0f}% |")
    print(f"\n(tau: mean over {len(taus['unquantized'])} runs; ms/cycle: median; greedy outputs "
          "identical across precisions, as exactness requires)")


if __name__ == "__main__":
    dflash2_mlx.use_fast_blas()      # MLX's float32 matmuls on MKL / OpenBLAS (Linux)
    main()
