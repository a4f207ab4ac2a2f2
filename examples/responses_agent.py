"""A two-turn tool-calling agent on `dflash2-mlx serve`, through the OpenAI Responses API.

    dflash2-mlx serve --model Qwen/Qwen3-0.6B     # in another terminal: a model whose chat
                                                  # template has tool calls
    python examples/responses_agent.py            # or: --base-url http://127.0.0.1:8080/v1

Turn 1 offers a `get_weather` function; the model answers with a `function_call` item, which
this script runs. Turn 2 sends the whole conversation again (the server stores nothing, so no
`previous_response_id`): the question, the model's output items as they came, and a
`function_call_output` item with the result; the model answers with the result in its context,
and the prefix cache serves the part of the prompt turn 1 already computed. Text is streamed as
it is generated. A model that answers without calling the tool ends the run after turn 1.

test-server: --model {tools} --draft {dflash2}
test-args: --base-url {base_url} --max-output-tokens 16
test-stdout: get_weather({"city": "Paris"}) -> sunny, 18 C
"""

import argparse
import json

from openai import OpenAI

TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city now.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}]


def get_weather(city: str) -> str:
    return "sunny, 18 C"        # a real agent would call a weather service here


def respond(client: OpenAI, model: str, conversation: list, max_output_tokens: int):
    """One turn, streamed: prints the text as it comes; returns the final response (completed,
    or incomplete when max_output_tokens cut it: `get_final_response` needs a completed one)."""
    with client.responses.stream(model=model, instructions="You are a concise assistant.",
                                 input=conversation, tools=TOOLS, temperature=0,
                                 max_output_tokens=max_output_tokens) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                print(event.delta, end="", flush=True)
            elif event.type == "response.output_text.done":
                print()
            elif event.type in ("response.completed", "response.incomplete"):
                final = event.response
    u = final.usage
    print(f"[{final.status}; {u.input_tokens} input tokens, "
          f"{u.input_tokens_details.cached_tokens} from the prefix cache; "
          f"{u.output_tokens} generated, tau {u.model_extra['dflash2'].get('tau', 1.0):.2f}]")
    return final


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    ap.add_argument("--api-key", default="none", help="the server's --api-key, if it has one")
    ap.add_argument("--max-output-tokens", type=int, default=256)
    a = ap.parse_args()

    client = OpenAI(base_url=a.base_url, api_key=a.api_key)
    model = client.models.list().data[0].id           # the one model the server serves
    conversation = [{"role": "user", "content": "What is the weather in Paris?"}]
    for turn in (1, 2):
        print(f">>> turn {turn}")
        response = respond(client, model, conversation, a.max_output_tokens)
        calls = [item for item in response.output if item.type == "function_call"]
        if not calls:
            if turn == 1:
                print("(the model answered without calling the tool)")
            return
        if turn == 2:
            print(f"(the model calls {', '.join(c.name for c in calls)} again; a real agent "
                  "loops until the model answers in text)")
            return
        conversation += response.output               # the model's items, as they came
        for call in calls:
            args = json.loads(call.arguments)
            result = get_weather(**args) if call.name == "get_weather" else "unknown tool"
            print(f"{call.name}({json.dumps(args)}) -> {result}")
            conversation.append({"type": "function_call_output", "call_id": call.call_id,
                                 "output": result})


if __name__ == "__main__":
    main()
