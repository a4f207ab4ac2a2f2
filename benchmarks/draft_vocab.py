"""A drafter with its draft vocabulary (`draft_vocab.json`) against the same weights proposing
over the full vocabulary: tau, ms per cycle and decode tokens/s, prompt by prompt, in one run.

    python benchmarks/draft_vocab.py                      # the shipped default pair
    python benchmarks/draft_vocab.py --drafter PATH --prompts 12 --max-tokens 128 --block-size 8

The two pipelines share the target; greedy outputs must be identical (checked).
"""

from __future__ import annotations

import argparse
import statistics

import dflash2_mlx
from dflash2_mlx.loading.checkpoint.assets import smollm2_gguf
from dflash2_mlx.loading.checkpoint.defaults import drafter_path
from dflash2_mlx.train.humaneval import humaneval_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="target (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--drafter", default=None, help="drafter folder with draft_vocab.json")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=8)
    a = ap.parse_args()

    model = a.model or str(smollm2_gguf())
    draft = a.drafter or str(drafter_path())
    restricted = dflash2_mlx.load(model, draft)
    if restricted.drafter.draft_vocab is None:
        raise SystemExit(f"{draft}: no draft_vocab.json, nothing to compare")
    full = dflash2_mlx.load(model, draft)
    full.drafter.draft_vocab = None
    print(f"draft vocabulary: {restricted.drafter.draft_vocab.ids.size} ids "
          f"of {restricted.adapter.vocab_size}")

    prompts = humaneval_prompts()[::13][: a.prompts]
    rows = {"full vocabulary": [], "draft vocabulary": []}
    for i, prompt in enumerate(prompts):
        ids = full.encode(prompt)
        outs = []
        for name, pipe in (("full vocabulary", full), ("draft vocabulary", restricted)):
            g = pipe.generate(ids, max_tokens=a.max_tokens, block_size=a.block_size)
            s = g.stats
            rows[name].append((s.tau, 1000 * s.decode_s / max(s.cycles, 1), s.decode_tps))
            outs.append(g.tokens)
        assert outs[0] == outs[1], f"prompt {i}: outputs differ"
        print(f"prompt {i + 1}/{len(prompts)}: " + "  ".join(
            f"{n}: tau {r[-1][0]:.2f}, {r[-1][1]:.1f} ms/cycle" for n, r in rows.items()),
            flush=True)
    print("\n| drafter head | tau | ms/cycle (median) | decode tok/s (mean) |\n|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {statistics.mean(x[0] for x in r):.3f} | "
              f"{statistics.median(x[1] for x in r):.1f} | "
              f"{statistics.mean(x[2] for x in r):.2f} |")
    print("greedy outputs identical: yes")


if __name__ == "__main__":
    main()
