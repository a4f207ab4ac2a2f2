"""Real tau of a drafter on HumanEval prompts: generation through `dflash2_mlx.load(...)`.

    python benchmarks/humaneval_tau.py --draft dflash2_mlx/loading/defaults --prompts 16 \\
        --max-tokens 128 --out docs/humaneval_tau.json

Default target: the embedded SmolLM2-135M-Instruct. Prompts: every k-th of the 164 HumanEval
problems (an even spread), each as one user turn through the chat template. Greedy and T = 1, each
with the drafter alone and with lookup (hybrid).
Evaluation only: HumanEval is never training data.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import dflash2_mlx
from dflash2_mlx.train.evaluate import real_eval
from dflash2_mlx.train.humaneval import humaneval_prompts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="target (default: embedded SmolLM2 .gguf)")
    p.add_argument("--draft", required=True)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    model = a.model
    if model is None:
        from dflash2_mlx.loading.checkpoint.assets import smollm2_gguf

        model = str(smollm2_gguf())
    pipe = dflash2_mlx.load(model, a.draft)
    every = max(1, 164 // a.prompts)
    prompts = humaneval_prompts()[::every][: a.prompts]
    results = {}
    runs = [(float(t), lookup) for t in a.temperatures.split(",") for lookup in (False, True)]
    for t, lookup in runs:
        r = real_eval(pipe, prompts, max_tokens=a.max_tokens, temperature=t,
                      block_size=a.block_size, seed=0, lookup=lookup)
        name = f"T={t:g}" + (" hybrid" if lookup else "")       # drafter alone / with lookup
        results[name] = r
        print(f"{name}: tau {r['tau']:.3f} over {r['prompts']} prompts, {r['tokens']} tokens, "
              f"{r['decode_tps']:.1f} tok/s, position acceptance "
              f"{[None if x is None else round(x, 2) for x in r['position_acceptance']]}",
              file=sys.stderr, flush=True)
    results["setup"] = {"draft": a.draft, "model": model, "prompts": len(prompts),
                        "prompt_stride": every, "max_tokens": a.max_tokens,
                        "block_size": a.block_size}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps({k: v.get("tau") for k, v in results.items() if "tau" in v}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
