"""Text-only requests on a vision-language target against the same target's text model, side by
side: what loading the image side costs a request that has no image.

    python benchmarks/vision_text_speed.py --families qwen3_5,gemma4,qwen2_5_vl --rounds 5

Per family, a random-weight checkpoint in the real format (`tests/vision_fixtures.py`, its text
model widened to --hidden, its layers as the fixture's, so a step costs more than overhead) is loaded
once by `dflash2_mlx.load` (mlx-lm's text model, mlx-vlm's tower). The two systems share that
model object: `vlm` is the pipeline as loaded (its layers run through the image view where
the family needs one: Qwen's multimodal rope, Gemma 4's two-way image mask), `text` a
`Pipeline` on the same model and tokenizer without the image side. Rounds alternate the
systems' order; each round generates --tokens greedy tokens from a text prompt, plain decoding (block
size 1) and the adaptive default (`auto`: lookup, no drafter). Prints each family's median
tok/s per system and their ratio; the outputs are checked equal.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))     # the random-weight VLM checkpoints (tests only)

PROMPT = "Write a story about a lighthouse keeper and a storm."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="qwen3_5,gemma4,qwen2_5_vl")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=1024)
    args = ap.parse_args()

    import dflash2_mlx
    import vision_fixtures as vf
    from dflash2_mlx.pipeline import Pipeline

    print(f"{'family':<12} {'block':<6} {'text tok/s':>10} {'vlm tok/s':>10} {'vlm/text':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            folder = vf.write_vlm(Path(tmp) / family, family, seed=0, text_overrides={
                "hidden_size": args.hidden, "intermediate_size": 4 * args.hidden, "num_attention_heads": args.hidden // 16,
                "num_key_value_heads": args.hidden // 64})     # head_dim 16, as the fixture's
            vlm = dflash2_mlx.load(str(folder), "none")
            assert vlm.vision is not None and vlm.image_refusal() is None, family
            text = Pipeline(vlm.target, vlm.tokenizer, None)
            for block in (1, "auto"):
                rates = {"text": [], "vlm": []}
                outs = {}
                for r in range(args.rounds):      # ABBA: neither system always goes first
                    for name, pipe in (("text", text), ("vlm", vlm))[::1 if r % 2 else -1]:
                        gen = pipe.generate(PROMPT, max_tokens=args.tokens, block_size=block)
                        rates[name].append(gen.stats.decode_tps)
                        outs.setdefault(name, gen.tokens)
                        assert gen.tokens == outs[name], (family, name)
                assert outs["text"] == outs["vlm"], family
                t, v = statistics.median(rates["text"]), statistics.median(rates["vlm"])
                print(f"{family:<12} {str(block):<6} {t:>10.1f} {v:>10.1f} {v / t:>8.3f}x",
                      flush=True)


if __name__ == "__main__":
    main()
