"""MKL against OpenBLAS in one process, end to end: plain, default-width and `auto` decoding on
the embedded default pair, the two libraries interleaved run by run (`dflash2_mlx.loading.checkpoint.blas.select`
switches MLX's gemm between them), outputs checked identical; then MLX matmuls of the decode
shapes. Prints ratios; absolute figures move with the machine's load.

    python benchmarks/blas_compare.py [--rounds 2] [--max-tokens 64] [--no-shapes]
"""

import argparse
import os
import time

os.environ.setdefault("DFLASH2_BLAS", "none")     # start from MLX's own; switched below

import mlx.core as mx  # noqa: E402

import dflash2_mlx  # noqa: E402
from dflash2_mlx.loading.checkpoint import blas  # noqa: E402

PROMPTS = ["Write a Python function that checks whether a number is prime.",
           "Explain what a hash table is in two sentences.",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\""]
# (name, block size, lookup): plain decoding, the drafter alone, and the default (auto, lookup)
MODES = (("plain", 1, False), ("b=8", 8, False), ("auto", "auto", False),
         ("auto+lookup", "auto", True))
LIBS = ("openblas", "mkl")


def end_to_end(rounds: int, max_tokens: int) -> None:
    from dflash2_mlx.pipeline import Pipeline
    from dflash2_mlx.bench.prompt_sets import agent_prompts

    base = dflash2_mlx.load()
    # one Pipeline per library over the same weights: each `auto` calibrates and learns its
    # costs under its own BLAS (the calibration key names the BLAS in effect)
    pipes = {lib: Pipeline(base.target, base.tokenizer, base.drafter, info=base.info)
             for lib in LIBS}
    for lib in LIBS:                                       # warm both (and calibrate auto)
        blas.select(lib)
        for _, b, lookup in MODES:
            pipes[lib].generate("hi", max_tokens=8, block_size=b, lookup=lookup)
    acc = {(lib, m): [0, 0.0] for lib in LIBS for m, _, _ in MODES}
    outputs = {}
    for r in range(rounds):
        for p in PROMPTS + agent_prompts(2):
            for m, b, lookup in MODES:
                for lib in (LIBS if r % 2 == 0 else LIBS[::-1]):   # alternate who goes first
                    assert blas.select(lib).name == lib
                    g = pipes[lib].generate(p, max_tokens=max_tokens, block_size=b,
                                            lookup=lookup)
                    acc[lib, m][0] += g.stats.generated_tokens - 1
                    acc[lib, m][1] += g.stats.decode_s
                    outputs.setdefault(p, set()).add(tuple(g.tokens))
    for m, _, _ in MODES:
        o, k = (acc[lib, m][0] / acc[lib, m][1] for lib in LIBS)
        print(f"{m:12s} openblas {o:6.2f} tok/s  mkl {k:6.2f} tok/s  mkl/openblas {k / o:.2f}x")
    print("identical outputs:", all(len(v) == 1 for v in outputs.values()))


def matmul_ms(M: int, K: int, N: int, n: int = 30) -> float:
    x, w = mx.random.normal((M, K)), mx.random.normal((N, K))
    mx.eval(x, w)
    for _ in range(3):
        mx.eval(x @ w.T)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        mx.eval(x @ w.T)
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2] * 1e3


def shapes() -> None:
    """x [M, K] @ W.T, W [N, K]: SmolLM2's projections, MLP and LM head (full, draft vocab)."""
    cases = [(M, K, N) for M in (1, 8, 64) for K, N in
             ((576, 576), (576, 1536), (1536, 576), (576, 49152), (576, 18241))]
    best = {}
    for _ in range(2):
        for lib in LIBS:
            blas.select(lib)
            for c in cases:
                best[lib, c] = min(best.get((lib, c), 1e9), matmul_ms(*c))
    for c in cases:
        o, k = best["openblas", c], best["mkl", c]
        print(f"M={c[0]:<3d} K={c[1]:<5d} N={c[2]:<6d} openblas {o:8.3f} ms  mkl {k:8.3f} ms  "
              f"mkl time / openblas time {k / o:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--no-shapes", action="store_true")
    args = parser.parse_args()
    missing = [lib for lib in LIBS if blas.find(lib) is None]
    if missing:
        raise SystemExit(f"not installed: {', '.join(missing)} (pip install mkl; "
                         "apt-get install libopenblas0-pthread)")
    end_to_end(args.rounds, args.max_tokens)
    if not args.no_shapes:
        shapes()


if __name__ == "__main__":
    main()
