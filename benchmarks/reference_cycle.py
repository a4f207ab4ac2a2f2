"""Side by side with the z-lab reference (`dflash.model_mlx`, PyPI `dflash==0.1.0`, installed
with --no-deps in a benchmark environment; the package itself never imports it).

1. Cross-check: the same DFlash 2 checkpoint loaded by both implementations, fed the same
   target features and block, gives the same drafter hidden states and the same proposals.
2. Cycle time: ms per draft-verify cycle of our engine and of `dflash.model_mlx.stream_generate`
   on the same target, drafter, prompts and block size, alternating runs; greedy outputs must
   be identical.

    python benchmarks/reference_cycle.py [--drafter DIR] [--block-size 8] [--max-tokens 64]

Without --drafter a random DFlash 2 drafter shaped for SmolLM2-135M-Instruct is written to a
temporary folder. The target is the embedded SmolLM2 GGUF (fp32 on CPU).
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
from dflash2_mlx.loading.checkpoint.checkpoint import load_target, save_drafter
from dflash2_mlx.testing import random_drafter, smollm2_drafter_args

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain what a hash table is in two sentences.",
    "Write a function that checks whether a string is a palindrome.",
]


def random_smollm2_drafter(folder: Path) -> Path:
    return save_drafter(random_drafter(smollm2_drafter_args(selector_rank=256), seed=0), folder)


def load_reference_drafter(folder: Path):
    import dflash.model_mlx as ref

    ref.snapshot_download = lambda path, **_: path   # the reference only takes hub ids
    draft = ref.load_draft(str(folder))
    draft.update(__import__("mlx.utils").utils.tree_map(
        lambda x: x.astype(mx.float32) if mx.issubdtype(x.dtype, mx.floating) else x,
        draft.parameters()))
    return draft


def cross_check(pipe, ref_draft) -> None:
    """Same features and block through both drafters: hidden states and proposals agree."""
    drafter, adapter = pipe.drafter, pipe.adapter
    ref_draft.bind(pipe.target)
    ids = mx.array([pipe.encode(PROMPTS[0])])
    _, feats = adapter.forward(ids, adapter.make_cache())
    block = mx.array([[ids[0, -1].item()] + [drafter.args.mask_token_id] * 7])
    ours = drafter(adapter.embed(block), feats, drafter.make_cache())
    from mlx_lm.models.cache import make_prompt_cache

    theirs = ref_draft.hidden_states(block, feats, make_prompt_cache(ref_draft))
    err = mx.abs(ours - theirs).max().item()
    from dflash2_mlx.decode.sampling import Sampling

    prop = drafter.propose(adapter, block[:, :1], feats, drafter.make_cache(), 8, Sampling(),
                           mx.random.key(0))
    ref_tokens = ref_draft.propose(block, feats, make_prompt_cache(ref_draft), 0.0,
                                   logits_start=1)[0]
    same = prop.tokens.tolist() == ref_tokens.tolist()
    print(f"cross-check: max |hidden ours - reference| = {err:.2e}; greedy proposals "
          f"{'identical' if same else 'DIFFER'}: {prop.tokens.tolist()[0]}")
    if err > 1e-3 or not same:
        raise SystemExit("cross-check failed")


def run_ours(pipe, prompt_ids, block_size, max_tokens):
    gen = pipe.generate(prompt_ids, max_tokens=max_tokens, block_size=block_size)
    return gen.tokens, gen.stats.decode_s, gen.stats.cycles


def run_reference(ref, target, ref_draft, tokenizer, prompt_ids, block_size, max_tokens):
    tokens, cycles, start = [], 0, None
    for resp in ref.stream_generate(target, ref_draft, tokenizer, prompt_ids,
                                    block_size=block_size, max_tokens=max_tokens):
        if start is None:                 # first response: prefill + first token
            start = time.perf_counter()
        elif resp.tokens:
            cycles += 1
        tokens += resp.tokens
    return tokens, time.perf_counter() - start, cycles


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", type=Path)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    opts = ap.parse_args()
    import dflash.model_mlx as ref

    tmp = tempfile.TemporaryDirectory()
    folder = opts.drafter or random_smollm2_drafter(Path(tmp.name))
    gguf = smollm2_gguf()
    pipe = dflash2_mlx.load(str(gguf), str(folder))
    ref_target, ref_tokenizer, _ = load_target(str(gguf), mx.float32)   # the reference wraps
    ref_draft = load_reference_drafter(folder)                          # layers in place
    cross_check(pipe, ref_draft)

    ours_ms, ref_ms = [], []
    for _ in range(opts.rounds):
        for prompt in PROMPTS:
            ids = pipe.encode(prompt)
            a, t_ours, c_ours = run_ours(pipe, ids, opts.block_size, opts.max_tokens)
            b, t_ref, c_ref = run_reference(ref, ref_target, ref_draft, ref_tokenizer, ids,
                                            opts.block_size, opts.max_tokens)
            if a[: len(b)] != b[: len(a)]:
                raise SystemExit(f"outputs differ on {prompt!r}")
            ours_ms.append(1000 * t_ours / c_ours)
            ref_ms.append(1000 * t_ref / c_ref)
            print(f"  {prompt[:40]!r:44} ours {ours_ms[-1]:6.1f} ms/cycle ({c_ours} cycles)  "
                  f"reference {ref_ms[-1]:6.1f} ms/cycle ({c_ref} cycles)")
    o, r = statistics.median(ours_ms), statistics.median(ref_ms)
    print(f"block size {opts.block_size}: ours {o:.1f} ms/cycle, reference {r:.1f} ms/cycle "
          f"(median of {len(ours_ms)}; reference/ours = {r / o:.2f}x); greedy outputs identical")


if __name__ == "__main__":
    dflash2_mlx.use_fast_blas()      # MLX's float32 matmuls on MKL / OpenBLAS (Linux)
    main()
