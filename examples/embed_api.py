"""Embed dflash2-mlx in an application: load once, then generate and stream as often as needed.

    python examples/embed_api.py                       # the embedded default pair
    python examples/embed_api.py --model TARGET --draft DRAFTER --max-tokens 64

test-args: --model {llama} --draft {dflash2} --max-tokens 8
"""

import argparse

import dflash2_mlx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="target (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--draft", help="drafter (default: the embedded default's)")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    # Loading is the slow part (seconds): do it once and keep the Pipeline around.
    pipe = dflash2_mlx.load(args.model, args.draft)

    # Whole answers: greedy decoding gives exactly what the target alone would write.
    gen = pipe.generate("Write a Python function that reverses a string.",
                        max_tokens=args.max_tokens)
    print(gen.text)
    print(f"[{gen.stats.generated_tokens} tokens, finish {gen.finish_reason}, "
          f"tau {gen.stats.tau:.2f}, {gen.stats.decode_tps:.1f} tok/s]")

    # Streaming, e.g. into a UI: each chunk is the text of the tokens just accepted.
    for chunk in pipe.stream("Name three colours.", max_tokens=args.max_tokens,
                             temperature=0.7, top_p=0.95, seed=0):
        print(chunk.text, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
