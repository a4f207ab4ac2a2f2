"""Break one draft-verify cycle down: where do the milliseconds go?

    python benchmarks/profile_cycle.py [--drafter DIR] [--block-size 8] [--cycles 40]

Runs the engine's pieces by hand on SmolLM2-135M-Instruct (fp32) with a synchronisation after
each, so every piece is timed alone:
  draft     embed the block, drafter forward, head, candidate walk -> proposals on the host
  verify    target forward over the block (logits + features)
  accept    greedy acceptance (argmax, prefix match) -> a and the bonus on the host
  rollback  cache trim and bookkeeping
then times the real engine (`stream_tokens`, one sync per cycle) on the same prompts, so the
sum of the pieces can be compared with the pipelined cycle. Without --drafter, a random DFlash 2
drafter shaped for SmolLM2 is used (acceptance ~0: one cycle per token).
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
from dflash2_mlx.policy.adaptive import FixedWidth
from dflash2_mlx.decode.state import DecodeState, prefill
from dflash2_mlx.decode.stats import GenerationStats
from dflash2_mlx.decode.engine import stream_tokens
from dflash2_mlx.decode.sampling import Sampling, greedy_accept

PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
           "Write a function that checks whether a string is a palindrome."]


def pieces(pipe, ids, width, cycles):
    """Per-piece times (ms), each piece followed by a sync."""
    target, drafter, sampling = pipe.adapter, pipe.drafter, Sampling()
    state = DecodeState.new(target, drafter)
    logits = prefill(target, state, ids, 2048, None)
    cache, dcache, feats = state.cache, state.dcache, state.take_features()
    anchor = mx.argmax(logits, axis=-1).reshape(1, 1).astype(mx.uint32)
    mx.eval(anchor, feats)
    times = {"draft": [], "verify": [], "accept": [], "rollback": []}
    for _ in range(cycles):
        t0 = time.perf_counter()
        proposal = drafter.propose(target, anchor, feats, dcache, width, sampling,
                                   mx.random.key(0))
        drafts = proposal.tokens.astype(mx.uint32)
        mx.eval(drafts)
        t1 = time.perf_counter()
        snapshot = target.snapshot(cache)
        logits, feats_all = target.forward(mx.concatenate([anchor, drafts], axis=1), cache)
        mx.eval(logits, feats_all)
        t2 = time.perf_counter()
        a, bonus = greedy_accept(drafts[0], mx.argmax(logits[0], axis=-1).astype(mx.uint32))
        a, bonus_id = a.item(), bonus.item()
        t3 = time.perf_counter()
        snapshot.rollback(a + 1, width)
        feats = feats_all[:, : a + 1]
        anchor = mx.array([[bonus_id]], dtype=mx.uint32)
        t4 = time.perf_counter()
        for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            times[k].append(1000 * v)
    return {k: statistics.median(v) for k, v in times.items()}


def engine_ms(pipe, ids, width, tokens):
    stats = GenerationStats()
    for _ in stream_tokens(pipe.adapter, pipe.drafter, ids, max_tokens=tokens,
                           sampling=Sampling(), policy=FixedWidth(width), stop_ids=set(),
                           stats=stats):
        pass
    return 1000 * stats.decode_s / stats.cycles, stats.tau


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", type=Path)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--cycles", type=int, default=40)
    opts = ap.parse_args()
    tmp = tempfile.TemporaryDirectory()
    if opts.drafter is None:
        from reference_cycle import random_smollm2_drafter     # (this script's folder)

        opts.drafter = random_smollm2_drafter(Path(tmp.name))
    pipe = dflash2_mlx.load(str(smollm2_gguf()), str(opts.drafter))
    # with a draft vocabulary, profile it against the full vocabulary, interleaved
    vocab = pipe.drafter.draft_vocab
    configs = {"draft vocabulary": vocab, "full vocabulary": None} if vocab else {"": None}
    rows: dict[str, list] = {name: [] for name in configs}
    for prompt in PROMPTS:
        ids = pipe.encode(prompt)
        for name, v in configs.items():
            pipe.drafter.draft_vocab = v
            rows[name].append((pieces(pipe, ids, opts.block_size, opts.cycles),
                               engine_ms(pipe, ids, opts.block_size, opts.cycles)))
    for name, r in rows.items():
        med = {k: statistics.median(x[0][k] for x in r) for k in r[0][0]}
        total = sum(med.values())
        print(f"{name + ': ' if name else ''}block size {opts.block_size}, median ms per cycle "
              f"over {len(PROMPTS)} prompts x {opts.cycles} cycles (each piece synchronised):")
        for k, v in med.items():
            print(f"  {k:9} {v:7.1f} ms  {100 * v / total:5.1f}%")
        print(f"  {'sum':9} {total:7.1f} ms")
        eng = statistics.median(x[1][0] for x in r)
        print(f"engine (one sync per cycle): {eng:.1f} ms per cycle, tau "
              f"{statistics.median(x[1][1] for x in r):.2f}")


if __name__ == "__main__":
    dflash2_mlx.use_fast_blas()      # MLX's float32 matmuls on MKL / OpenBLAS (Linux)
    main()
