"""The quantized KV cache's bytes: per token, measured on the target's own caches at each
setting (float, 8-bit, 4-bit) and context length, against the formula
(`model.views.kv_bytes_per_token`), and how many tokens the prefix cache keeps in the bytes
of a float32 state.

    python -m dflash2_mlx.bench.kv_bytes --contexts 1024,8192 [--model M]

The caches are filled by writing keys and values of the model's shapes in prefill-sized chunks
(2048 rows, as `Pipeline` prefills) through each cache's `update_and_fetch`, which is what a
forward writes; no forward runs, so 8k tokens take seconds. Prints one JSON line per setting
and context."""

from __future__ import annotations

import argparse
import json

import dflash2_mlx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="target (default: the embedded default)")
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--chunk", type=int, default=2048)
    args = ap.parse_args()

    import mlx.core as mx

    from dflash2_mlx.decode.state import cache_nbytes
    from dflash2_mlx.model.target import KVQuant, TargetAdapter
    from dflash2_mlx.model.views import kv_bytes_per_token

    pipe = dflash2_mlx.load(args.model, lookup=False) if args.model else dflash2_mlx.load()
    model = pipe.target
    probe = TargetAdapter(model).make_cache()
    model(mx.zeros((1, 1), mx.uint32), cache=probe)         # one token: the caches' shapes
    attention = [i for i, c in enumerate(probe) if type(c).__name__ == "KVCache"]
    _, n_kv, _, head_dim = probe[attention[0]].keys.shape
    dtype = probe[attention[0]].keys.dtype
    dtype_name = str(dtype).rsplit(".", 1)[-1]
    held = {}
    for n in (int(x) for x in args.contexts.split(",")):
        for kv in (None, KVQuant(8, 64), KVQuant(4, 64)):
            cache = TargetAdapter(model, kv=kv).make_cache()
            mx.random.seed(0)
            for start in range(0, n, args.chunk):
                t = min(args.chunk, n - start)
                for i in attention:
                    keys, values = (mx.random.normal((1, n_kv, t, head_dim), dtype=dtype)
                                    for _ in range(2))
                    cache[i].update_and_fetch(keys, values)
                mx.eval([cache[i].state for i in attention])
            allocated = sum(cache_nbytes(cache[i]) for i in attention)
            first = cache[attention[0]].keys
            rows = (first[0] if kv else first).shape[2]
            measured = allocated / (rows * len(attention))    # per row of the buffer, per layer
            formula = kv_bytes_per_token(n_kv, head_dim, kv, dtype.size)
            held.setdefault(n, {})[str(kv or "float")] = allocated
            print(json.dumps({"context": n, "kv": str(kv or f"float ({dtype_name})"),
                              "layers": len(attention), "n_kv_heads": n_kv,
                              "head_dim": head_dim,
                              "bytes_per_token_per_layer": measured, "formula": formula,
                              "equal": measured == formula, "buffer_rows": rows,
                              "kv_bytes": allocated, "kv_mib_per_1k_tokens":
                              round(allocated / n * 1024 / 2**20, 3)}))
    for n, sizes in held.items():
        base = sizes["float"]
        print(json.dumps({"context": n, "prefix_cache_tokens_vs_float_in_the_same_bytes":
                          {k: round(base / v, 2) for k, v in sizes.items()}}))


if __name__ == "__main__":
    main()
