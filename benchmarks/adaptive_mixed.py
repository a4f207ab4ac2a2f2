"""`block_size="auto"` against every fixed block size on mixed content: code and chat prompts,
alternating, one run, the systems interleaved prompt by prompt.

    python benchmarks/adaptive_mixed.py [--drafter DIR] [--prompts 8] [--max-tokens 96]

Code prompts are HumanEval problems; chat prompts are everyday questions written here. Per
system: decode tok/s over all prompts, and per prompt kind. Greedy; outputs are checked
identical across systems. `auto` keeps its acceptance estimates from prompt to prompt (one
Pipeline), so it has to notice each switch of content.
"""

from __future__ import annotations

import argparse

import dflash2_mlx
from dflash2_mlx.loading.checkpoint.assets import smollm2_gguf
from dflash2_mlx.loading.checkpoint.defaults import drafter_path
from dflash2_mlx.bench.prompt_sets import CHAT
from dflash2_mlx.train.humaneval import humaneval_prompts

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="target (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--drafter", default=None, help="drafter (default: the shipped one)")
    ap.add_argument("--prompts", type=int, default=8, help="in all, half code, half chat")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--block-sizes", default="1,2,3,4,8")
    a = ap.parse_args()

    pipe = dflash2_mlx.load(a.model or str(smollm2_gguf()), a.drafter or str(drafter_path()))
    pipe.width_policy()                                   # calibrate before timing anything
    code = humaneval_prompts()[::17]
    prompts = []
    for i in range(a.prompts):
        prompts.append(("code", code[i // 2]) if i % 2 == 0 else ("chat", CHAT[i // 2 % len(CHAT)]))
    systems = [int(b) for b in a.block_sizes.split(",")] + ["auto"]
    done: dict = {s: {"code": [0, 0.0], "chat": [0, 0.0]} for s in systems}
    for i, (kind, prompt) in enumerate(prompts):
        outs = []
        for b in systems:
            g = pipe.generate(prompt, max_tokens=a.max_tokens, block_size=b)
            done[b][kind][0] += g.stats.generated_tokens - 1
            done[b][kind][1] += g.stats.decode_s
            outs.append(g.tokens)
        assert all(o == outs[0] for o in outs), f"prompt {i}: outputs differ"
        print(f"prompt {i + 1}/{len(prompts)} ({kind}) done", flush=True)

    def tps(parts):
        n = sum(p[0] for p in parts)
        s = sum(p[1] for p in parts)
        return n / s if s else 0.0

    rows = {b: (tps([d["code"], d["chat"]]), tps([d["code"]]), tps([d["chat"]]))
            for b, d in done.items()}
    best = max((b for b in systems if b != "auto"), key=lambda b: rows[b][0])
    print("\n| block size | tok/s all | tok/s code | tok/s chat |\n|---|---|---|---|")
    for b, (t_all, t_code, t_chat) in rows.items():
        print(f"| {b} | {t_all:.2f} | {t_code:.2f} | {t_chat:.2f} |")
    print(f"\nbest fixed: {best}; auto / best fixed = {rows['auto'][0] / rows[best][0]:.3f}; "
          "greedy outputs identical across all block sizes")


if __name__ == "__main__":
    main()
