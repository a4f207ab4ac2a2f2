"""Memory on a long prompt: a sliding-window drafter keeps only the context it can still see.

    python benchmarks/sliding_memory.py [--prompt-tokens 6000] [--window 512]

Two random DFlash 2 drafters shaped for SmolLM2-135M-Instruct, identical but for `layer_types`
(all `sliding_attention` with the given window, or all `full_attention`), generate 16 tokens
after the same long prompt. Printed per drafter: MLX memory held at the end of the generation
(weights, the target's KV cache, the drafter's context: only the last differs), the peak over
prefill + generation (dominated by the target's prefill attention) and the prefill time.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import dflash2_mlx
import mlx.core as mx

from dflash2_mlx.loading.checkpoint.assets import smollm2_gguf
from dflash2_mlx.policy.adaptive import FixedWidth
from dflash2_mlx.decode.stats import GenerationStats
from dflash2_mlx.decode.engine import stream_tokens
from dflash2_mlx.loading.checkpoint.checkpoint import load_drafter, save_drafter
from dflash2_mlx.pipeline import Pipeline
from dflash2_mlx.decode.sampling import Sampling
from dflash2_mlx.testing import random_drafter, smollm2_drafter_args


def drafter_folder(root: Path, window: int | None) -> Path:
    kinds = ("sliding_attention",) * 2 if window else ("full_attention",) * 2
    args = smollm2_drafter_args(layer_types=kinds, sliding_window=window)
    return save_drafter(random_drafter(args, seed=0), root / (f"w{window}" if window else "full"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=6000)
    ap.add_argument("--window", type=int, default=512)
    opts = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    pipe = dflash2_mlx.load(str(smollm2_gguf()))
    text = " ".join(f"Item {i}: the value of x{i} is {i * 7 % 101}." for i in range(int(opts.prompt_tokens / 15) + 50))
    ids = pipe.encode(text, chat_template=False)[: opts.prompt_tokens]
    print(f"prompt: {len(ids)} tokens; SmolLM2-135M-Instruct fp32 target")
    for window in (opts.window, None):
        drafter = load_drafter(drafter_folder(tmp, window), hidden_size=576, vocab_size=49152,
                               num_layers=30, dtype=mx.float32)
        p = Pipeline(pipe.target, pipe.tokenizer, drafter)
        mx.clear_cache()
        mx.reset_peak_memory()
        stats = GenerationStats()
        steps = stream_tokens(p.adapter, drafter, ids, max_tokens=16, sampling=Sampling(),
                              policy=FixedWidth(8), stop_ids=set(), stats=stats)
        while stats.generated_tokens < 16:     # stop at the last yield: its state is alive
            next(steps)
        mx.eval(drafter.parameters())
        held = mx.get_active_memory() / 2**20
        peak = mx.get_peak_memory() / 2**20
        steps.close()
        label = f"sliding window {window}" if window else "full attention"
        print(f"{label:>22}: held after generating {held:7.1f} MiB, peak {peak:7.1f} MiB, "
              f"prefill {stats.prefill_s:5.1f} s")
    print("(held memory differs by the drafter's context: target features and drafter K/V of "
          "every prompt row with full attention, of the last window-1 rows with a window)")


if __name__ == "__main__":
    dflash2_mlx.use_fast_blas()      # MLX's float32 matmuls on MKL / OpenBLAS (Linux)
    main()
