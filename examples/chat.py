"""A terminal chat that keeps the conversation: each turn is generated with every earlier turn
in the prompt, through the tokenizer's chat template.

    python examples/chat.py [--model TARGET --draft DRAFTER] [--system "You are terse."]
    printf 'Hi!\nAnd in French?\n' | python examples/chat.py      # one line per user turn

An empty line is skipped; "/reset" forgets the conversation; end with Ctrl-D (or /quit).

test-args: --model {llama} --draft {dflash2} --max-tokens 6
test-stdin: Hello!\n/reset\nWhat is 2 + 2?\n
"""

import argparse
import sys

import dflash2_mlx


def render(pipe, messages: list[dict]) -> list[int]:
    """The whole conversation as prompt ids, ready for the assistant's next turn."""
    tok = pipe.tokenizer
    if not getattr(tok, "has_chat_template", False):      # a base model: plain transcript
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return tok.encode(text)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--draft")
    parser.add_argument("--system", help="a system message")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temp", type=float, default=0.0)
    args = parser.parse_args()

    pipe = dflash2_mlx.load(args.model, args.draft)
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("you> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/quit":
            break
        user = line.strip()
        if not user:
            continue
        if user == "/reset":
            messages = list(start)
            print("(conversation cleared)")
            continue
        messages.append({"role": "user", "content": user})
        print("assistant> ", end="", flush=True)
        reply = []
        for chunk in pipe.stream(render(pipe, messages), max_tokens=args.max_tokens,
                                 temperature=args.temp):
            print(chunk.text, end="", flush=True)
            reply.append(chunk.text)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})


if __name__ == "__main__":
    main()
