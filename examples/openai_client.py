"""A two-turn chat with `dflash2-mlx serve` through the official `openai` client.

    dflash2-mlx serve                       # in another terminal: the embedded default pair
    python examples/openai_client.py        # or: --base-url http://127.0.0.1:8080/v1

The second turn reuses the first turn's caches (`usage.prompt_tokens_details.cached_tokens`);
`usage.dflash2` carries the acceptance figures of each request.

test-server: --model {llama} --draft {dflash2}
test-args: --base-url {base_url} --max-tokens 8
"""

import argparse

from openai import OpenAI


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    ap.add_argument("--api-key", default="none", help="the server's --api-key, if it has one")
    ap.add_argument("--max-tokens", type=int, default=96)
    a = ap.parse_args()

    client = OpenAI(base_url=a.base_url, api_key=a.api_key)
    model = client.models.list().data[0].id           # the one model the server serves
    messages = [{"role": "system", "content": "You are a concise Python assistant."}]
    for question in ("Write a Python function that checks whether a number is prime.",
                     "Now add a docstring to it."):
        messages.append({"role": "user", "content": question})
        print(f">>> {question}")
        text, usage = [], None
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=a.max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        messages.append({"role": "assistant", "content": "".join(text)})
        figures = usage.model_extra.get("dflash2", {})
        print(f"\n[{usage.prompt_tokens} prompt tokens, "
              f"{usage.prompt_tokens_details.cached_tokens} from the prefix cache; "
              f"{usage.completion_tokens} generated, tau {figures.get('tau', 1.0):.2f}, "
              f"{figures.get('decode_tps', 0):.1f} tok/s decode]\n")


if __name__ == "__main__":
    main()
