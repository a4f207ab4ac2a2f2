"""Per-call timings of the two DFlash 2 kernels: short convolution and candidate path walk.

    python benchmarks/bench_kernels.py            # CPU here; on a Mac also the Metal kernels
    python benchmarks/bench_kernels.py --quick    # fewer repetitions

Columns (microseconds per call, median of many, each call evaluated):
- loop:  a straightforward per-position Python loop of MLX ops, in the style of the reference
         implementation (its `_grouped_dynamic_convolve` / `CandidateSelector.select`), not
         compiled;
- ops:   our MLX-ops twin through the dispatcher (`kernels.short_conv` / `kernels.path_walk`,
         path="ops", wrapped in mx.compile);
- metal: the custom Metal kernels (path="metal"), only where Metal is usable.
The walk is timed from the codebooks, so every column includes the codebook row gathers the
drafter does. A last table times the two formulations of the walk on the ops path (the pair
lattice at once, as `path_walk_ops` and the Metal path do, vs per-step rows, as the loop does),
the measurement behind the Metal walk taking a lattice.
"""

from __future__ import annotations

import argparse
import statistics
import time

import dflash2_mlx
import mlx.core as mx

from dflash2_mlx.model.kernels import metal_usable, path_walk, short_conv
from dflash2_mlx.model.kernels.ops import _pick

GROUP, TAPS, K, R, VOCAB = 16, 2, 16, 256, 49152


def timeit(fn, *args, reps: int) -> float:
    """Median microseconds of fn(*args) with its outputs evaluated."""
    for _ in range(5):
        mx.eval(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        mx.eval(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


# ------------------------------------------------------------------ per-position loops

def conv_loop(y, dyn, base, residual):
    """One conv side, one block row at a time: out_t = sum_tap (base + dyn_t) * y_{t-tap}."""
    B, L, H = y.shape
    groups = dyn.shape[-1]
    rows = []
    for t in range(L):
        acc = mx.zeros((B, H), y.dtype)
        for tap in range(min(base.shape[0], t + 1)):
            coef = base[tap] + mx.repeat(dyn[:, t, tap], H // groups, axis=-1)
            acc = acc + coef * y[:, t - tap]
        rows.append(acc + residual[:, t])
    return mx.stack(rows, axis=1)


def walk_loop(cand, unary, g, pred_book, succ_book, anchor, temperature, uniforms):
    """The walk one row at a time, scoring the candidates against the chosen predecessor."""
    prev, ids, qs = anchor, [], []
    for t in range(cand.shape[1]):
        edges = (pred_book[prev][:, None] * g[:, t, None] * succ_book[cand[:, t]]).sum(-1)
        scores = unary[:, t] + edges
        if uniforms is None:
            index = mx.argmax(scores, axis=-1)
        else:
            q = mx.softmax(scores.astype(mx.float32) / temperature, axis=-1)
            index = mx.minimum((mx.cumsum(q, axis=-1) <= uniforms[:, t, None]).sum(-1), K - 1)
            qs.append(q)
        prev = mx.take_along_axis(cand[:, t], index[:, None], axis=-1)[:, 0]
        ids.append(prev)
    return mx.stack(ids, axis=1), (mx.stack(qs, axis=1) if qs else None)


def walk_rows_ops(cand, unary, g, pred_rows, succ_rows, anchor_pred, temperature, uniforms):
    """`path_walk_ops` with per-step rows instead of the lattice: one [K, R] x [R] product per
    step against the chosen predecessor's row."""
    prev, indices, qs = anchor_pred, [], []
    for t in range(cand.shape[1]):
        scores = unary[:, t] + ((g[:, t, None] * succ_rows[:, t]) @ prev[..., None])[..., 0]
        index, q = _pick(scores, temperature, None if uniforms is None else uniforms[:, t])
        indices.append(index)
        qs.append(q)
        prev = mx.take_along_axis(pred_rows[:, t], index[:, None, None], axis=1)[:, 0]
    ids = mx.take_along_axis(cand, mx.stack(indices, 1)[..., None], axis=-1)[..., 0]
    return ids, (None if uniforms is None else mx.stack(qs, 1))


# ------------------------------------------------------------------ the tables

def conv_table(dtype, reps, paths):
    print(f"\nshort conv, one side + residual, B=1, K={TAPS} taps, G={GROUP}, {dtype}")
    print(f"{'shape':>16} {'loop us':>9} " + " ".join(f"{p + ' us':>9}" for p in paths)
          + f" {'loop/ops':>9}")
    for H in (576, 2560):
        for L in (8, 16):
            keys = mx.random.split(mx.random.key(H + L), 4)
            y = mx.random.normal((1, L, H), key=keys[0]).astype(dtype)
            dyn = mx.random.normal((1, L, TAPS, H // GROUP), key=keys[1]).astype(dtype)
            base = mx.random.normal((TAPS, H), key=keys[2]).astype(dtype)
            res = mx.random.normal((1, L, H), key=keys[3]).astype(dtype)
            loop = timeit(conv_loop, y, dyn, base, res, reps=reps)
            times = [timeit(lambda *a, p=p: short_conv(*a, path=p), y, dyn, base, res, reps=reps)
                     for p in paths]
            print(f"{f'H={H} L={L}':>16} {loop:9.0f} " + " ".join(f"{t:9.0f}" for t in times)
                  + f" {loop / times[0]:8.1f}x")


def walk_problem(L, dtype, seed):
    keys = mx.random.split(mx.random.key(seed), 7)
    cand = mx.random.randint(0, VOCAB, (1, L, K), key=keys[0]).astype(mx.uint32)
    unary = mx.random.normal((1, L, K), key=keys[1]).astype(dtype)
    g = mx.random.normal((1, L, R), key=keys[2]).astype(dtype)
    pred_book = (0.1 * mx.random.normal((VOCAB, R), key=keys[3])).astype(dtype)
    succ_book = (0.1 * mx.random.normal((VOCAB, R), key=keys[4])).astype(dtype)
    anchor = mx.random.randint(0, VOCAB, (1,), key=keys[5]).astype(mx.uint32)
    uniforms = mx.random.uniform(shape=(1, L), key=keys[6])
    return (cand, unary, g, pred_book, succ_book, anchor), uniforms


def walk_from_books(path):
    def walk(cand, unary, g, pred_book, succ_book, anchor, temperature, uniforms):
        return path_walk(cand, unary, g, pred_book[cand], succ_book[cand], pred_book[anchor],
                         temperature, uniforms, path=path)
    return walk


def walk_table(dtype, reps, paths):
    print(f"\npath walk, B=1, K={K}, R={R}, codebooks [{VOCAB}, {R}], {dtype}")
    print(f"{'shape':>16} {'loop us':>9} " + " ".join(f"{p + ' us':>9}" for p in paths)
          + f" {'loop/ops':>9}")
    for mode, temperature in (("greedy", 0.0), ("sample", 0.8)):
        for L in (8, 16):
            books, u = walk_problem(L, dtype, seed=L)
            u = u if temperature > 0 else None
            loop = timeit(walk_loop, *books, temperature, u, reps=reps)
            times = [timeit(walk_from_books(p), *books, temperature, u, reps=reps) for p in paths]
            print(f"{f'{mode} L={L}':>16} {loop:9.0f} " + " ".join(f"{t:9.0f}" for t in times)
                  + f" {loop / times[0]:8.1f}x")


def walk_formulation_table(dtype, reps):
    from dflash2_mlx.model.kernels import path_walk_ops

    print(f"\nwalk formulations on the ops path (compiled, rows already gathered), {dtype}")
    print(f"{'shape':>16} {'lattice us':>11} {'rows us':>9}")
    lattice = mx.compile(lambda *a: path_walk_ops(*a)[0])
    rows = mx.compile(lambda *a: walk_rows_ops(*a, 0.0, None)[0])
    for L in (8, 16):
        (cand, unary, g, pb, sb, anchor), _ = walk_problem(L, dtype, seed=L)
        args = (cand, unary, g, pb[cand], sb[cand], pb[anchor])
        mx.eval(args)
        assert mx.array_equal(lattice(*args), rows(*args)).item()
        print(f"{f'greedy L={L}':>16} {timeit(lattice, *args, reps=reps):11.0f} "
              f"{timeit(rows, *args, reps=reps):9.0f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                        help="default: bfloat16 with Metal, float32 on the CPU")
    args = parser.parse_args()
    reps = 15 if args.quick else 60
    metal = metal_usable()
    dtype = getattr(mx, args.dtype or ("bfloat16" if metal else "float32"))
    paths = ["ops", "metal"] if metal else ["ops"]
    print(f"MLX {mx.__version__}, device {mx.default_device()}, Metal kernels: "
          f"{'yes' if metal else 'no (Metal unavailable)'}")
    conv_table(dtype, reps, paths)
    walk_table(dtype, reps, paths)
    walk_formulation_table(dtype, reps)


if __name__ == "__main__":
    dflash2_mlx.use_fast_blas()      # MLX's float32 matmuls on MKL / OpenBLAS (Linux)
    main()
