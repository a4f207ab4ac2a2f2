"""The verify kernels' probe as a table: stock against custom per shape class and width, the
custom result's error and the decision (`model.kernel_probe`). Run it on a Mac and paste the
table into an issue to report that chip's figures.

    python -m dflash2_mlx.bench.verify_kernels                      # typical shape classes
    python -m dflash2_mlx.bench.verify_kernels --model mlx-community/Qwen3-8B-4bit
    python -m dflash2_mlx.bench.verify_kernels --context 16384
    python -m dflash2_mlx.bench.verify_kernels --model ... --kv-bits 8   # quantized KV cache

Without --model: a Qwen3-8B-like target at 4 bits (attention 32/8 heads of 128, over a float
and over an 8- and 4-bit group-64 KV cache; projections 4096 -> 4096, 4096 -> 12288,
12288 -> 4096, group 64) in bfloat16, and a head dim 64 and 256 attention. Off Metal it says so and prints nothing else (the probe needs an Apple GPU).
"""

from __future__ import annotations

import argparse
import sys

import mlx.core as mx

from dflash2_mlx.model.kernels import metal_usable
from dflash2_mlx.model import kernel_probe as kp

DEFAULT_SHAPES = [
    kp.ShapeClass("attention", (32, 8, 128, 0, 0), "bfloat16"),
    kp.ShapeClass("attention", (16, 4, 64, 0, 0), "bfloat16"),
    kp.ShapeClass("attention", (16, 8, 256, 0, 0), "bfloat16"),
    kp.ShapeClass("qattention", (32, 8, 128, 8, 64), "bfloat16"),
    kp.ShapeClass("qattention", (32, 8, 128, 4, 64), "bfloat16"),
    kp.ShapeClass("qmm", (4096, 4096, 4, 64), "bfloat16"),
    kp.ShapeClass("qmm", (12288, 4096, 4, 64), "bfloat16"),
    kp.ShapeClass("qmm", (4096, 12288, 4, 64), "bfloat16"),
    kp.ShapeClass("qmm", (4096, 4096, 8, 64), "bfloat16"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="take the shape classes from this mlx-lm model")
    ap.add_argument("--context", type=int, default=kp.PROBE_CONTEXT,
                    help=f"keys the attention probe reads (default {kp.PROBE_CONTEXT})")
    ap.add_argument("--reps", type=int, default=kp.PROBE_REPS)
    ap.add_argument("--kv-bits", type=int, choices=(4, 8),
                    help="with --model: its full-attention layers read a quantized KV cache")
    ap.add_argument("--kv-group-size", type=int, default=64, choices=(32, 64, 128))
    args = ap.parse_args()
    if not metal_usable():
        print(f"no Metal GPU here (mx.metal.is_available()={mx.metal.is_available()}): the "
              "probe times the custom kernels on Apple silicon only", file=sys.stderr)
        return
    shapes = DEFAULT_SHAPES
    if args.model:
        from mlx_lm import load

        from dflash2_mlx.model.views import KVQuant

        kv = KVQuant(args.kv_bits, args.kv_group_size) if args.kv_bits else None
        shapes = kp.shape_classes(load(args.model)[0], kv)
    print(f"{kp.machine_chip()}, MLX {mx.__version__}, context {args.context}\n")
    print(kp.probe_table(kp.probe(shapes, context=args.context, reps=args.reps)))


if __name__ == "__main__":
    main()
