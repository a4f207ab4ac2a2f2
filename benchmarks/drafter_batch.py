"""n separate drafter passes against one batched pass (`Drafter.propose_batch`), n = 1 to 16.

    python benchmarks/drafter_batch.py [--model M --draft D] [--batch 1,2,4,8,16]
                                       [--context 128] [--width 8] [--new 3] [--reps 5]
                                       [--attention]

The embedded pair by default (its drafter's shape; the weights do not change the cost). Every
sequence has a drafter context of `--context` rows of random target features and reads `--new`
new rows per pass (the accepted rows of a cycle), greedy, width `--width` for all (`--mixed`:
widths 2..width in turn). "separate": n `propose` calls, evaluated together as the batch engine
used to (one `mx.eval` after all of them); "batched": one `propose_batch`. Medians of
`--reps` after one warm-up; proposals that differ between the two are counted. One run on a
shared machine: only ratios within a row mean much; the load average is printed.

`--attention`: the layout choice for the block attention, one layer's attention alone at the
drafter's head shape: a loop of n calls, each sequence against its own cache (what the drafter
does), against one call over the caches copied into a padded [n, n_kv, max S + L, D] with a
mask (contexts spread over 0.5-1.5x `--context`, so they are ragged).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import mlx.core as mx

import dflash2_mlx
from dflash2_mlx.model.drafter import Draft
from dflash2_mlx.decode.sampling import Sampling


def _caches(drafter, n: int, feats: mx.array) -> list:
    caches = [drafter.make_cache() for _ in range(n)]
    for c in caches:
        drafter(mx.zeros((1, 1, drafter.args.hidden_size)), feats, c)
    mx.eval([(l.keys, l.values) for c in caches for l in c])
    return caches


def attention_layouts(drafter, n: int, context: int, L: int, reps: int) -> tuple[float, float]:
    """-> median ms of (n per-sequence attention calls, one padded batched call)."""
    a = drafter.layers[0].self_attn
    d = drafter.args.head_dim
    sizes = [int(context * (0.5 + i / max(n - 1, 1))) + L for i in range(n)]
    q = mx.random.normal((n, a.n_heads, L, d))
    kv = [(mx.random.normal((1, a.n_kv_heads, s, d)), mx.random.normal((1, a.n_kv_heads, s, d)))
          for s in sizes]
    mx.eval(q, kv)
    most = max(sizes)
    visible = mx.arange(most)[None, :] < mx.array(sizes)[:, None]            # [n, S]

    def loop():
        return mx.concatenate([mx.fast.scaled_dot_product_attention(
            q[i : i + 1], k, v, scale=a.scale) for i, (k, v) in enumerate(kv)])

    def padded():
        pad = lambda x: mx.pad(x, [(0, 0), (0, 0), (0, most - x.shape[2]), (0, 0)])
        keys = mx.concatenate([pad(k) for k, _ in kv])
        values = mx.concatenate([pad(v) for _, v in kv])
        mask = mx.broadcast_to(visible[:, None, None, :], (n, 1, L, most))
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=a.scale, mask=mask)

    assert mx.allclose(loop(), padded(), atol=1e-4)
    times = []
    for fn in (loop, padded):
        ms = []
        for rep in range(reps + 1):
            tic = time.perf_counter()
            mx.eval(fn())
            if rep:
                ms.append(1e3 * (time.perf_counter() - tic))
        times.append(statistics.median(ms))
    return times[0], times[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--batch", default="1,2,4,8,16")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--mixed", action="store_true", help="widths 2..width in turn")
    ap.add_argument("--new", type=int, default=3, help="new context rows per pass")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--attention", action="store_true", help="the attention layouts only")
    a = ap.parse_args()
    pipe = dflash2_mlx.load(a.model, a.draft)
    target, drafter = pipe.adapter, pipe.drafter
    if a.attention:
        print(f"load average before: {os.getloadavg()}")
        print(f"one layer's block attention, {a.width} rows, contexts 0.5-1.5x {a.context}")
        print("| n | per-sequence calls ms | padded batch ms | padded / per-sequence |")
        print("|---|---|---|---|")
        for n in [int(x) for x in a.batch.split(",")]:
            loop, padded = attention_layouts(drafter, n, a.context, a.width, a.reps)
            print(f"| {n} | {loop:.2f} | {padded:.2f} | {padded / loop:.2f} |", flush=True)
        print(f"load average after: {os.getloadavg()}")
        return
    F = len(drafter.args.target_layer_ids) * drafter.args.hidden_size
    greedy = Sampling()
    print(f"load average before: {os.getloadavg()}")
    print(f"context {a.context}, {a.new} new rows per pass, width "
          f"{'2..' if a.mixed else ''}{a.width}, {drafter.args.num_hidden_layers} layers")
    print("| n | n separate passes ms | one batched pass ms | separate / batched |")
    print("|---|---|---|---|")
    for n in [int(x) for x in a.batch.split(",")]:
        feats = mx.random.normal((1, a.context, F), key=mx.random.key(n))
        new = mx.random.normal((a.reps + 1, n, a.new, F), key=mx.random.key(n + 1))
        widths = [2 + i % (a.width - 1) if a.mixed else a.width for i in range(n)]
        anchors = [mx.array([[100 + i]], dtype=mx.uint32) for i in range(n)]
        times, differ = {"separate": [], "batched": []}, 0
        cache = {k: _caches(drafter, n, feats) for k in times}
        for rep in range(a.reps + 1):
            drafts = {k: [Draft(anchors[i], new[rep, i : i + 1], cache[k][i], widths[i],
                                greedy, mx.random.key(i)) for i in range(n)] for k in times}
            out = {}
            for kind in times:             # alternating, so load shifts hit both alike
                tic = time.perf_counter()
                if kind == "separate":
                    out[kind] = [drafter.propose(target, *d) for d in drafts[kind]]
                else:
                    out[kind] = drafter.propose_batch(target, drafts[kind])
                mx.eval([p.tokens for p in out[kind]])
                if rep:
                    times[kind].append(1e3 * (time.perf_counter() - tic))
            differ += sum(x.tokens.tolist() != y.tokens.tolist()
                          for x, y in zip(out["separate"], out["batched"]))
        sep, bat = (statistics.median(times[k]) for k in ("separate", "batched"))
        print(f"| {n} | {sep:.1f} | {bat:.1f} | {sep / bat:.2f} |"
              + (f" ({differ} proposals differed: near-ties?)" if differ else ""), flush=True)
        del cache
        mx.clear_cache()
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
