"""`POST /v1/responses` through the real `openai` client (`responses.create`,
`responses.stream`) against a `dflash2-mlx serve` subprocess on loopback, on the tiny fixtures:
the same greedy text as chat completions for the same conversation, a tool round trip
(function_call, then function_call_output), the typed event stream in order and in the shapes
openai-python's types parse, and a clear 400 for every field that is not served. (The full
queue's 429 on this route is tested with the other routes', in process: test_server.py.)
"""

from __future__ import annotations

import json
import re
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

from fixtures import CAP, KEY, TOOL_CALL, Server  # noqa: E402

pytestmark = pytest.mark.server

EVENT = TypeAdapter(ResponseStreamEvent)
INSTRUCTIONS = "You are a small assistant, turn by turn."
TURNS = [{"role": "user", "content": [{"type": "input_text", "text": "def add(a, b):"}]},
         {"role": "assistant", "content": [{"type": "output_text", "text": "return a + b"}]},
         {"role": "user", "content": "for i in range(10):"}]
CHAT_TURNS = [{"role": "system", "content": INSTRUCTIONS},
              {"role": "user", "content": "def add(a, b):"},
              {"role": "assistant", "content": "return a + b"},
              {"role": "user", "content": "for i in range(10):"}]
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
CHAT_WEATHER = {"type": "function", "function": {k: WEATHER[k] for k in
                                                 ("name", "description", "parameters")}}


def post(server, body, key=KEY, stream=False):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if stream:
        return httpx.stream("POST", server.url + "/v1/responses", json=body, headers=headers,
                            timeout=60)
    return httpx.post(server.url + "/v1/responses", json=body, headers=headers, timeout=60)


def raw_events(server, body) -> list[dict]:
    """The SSE events of a streamed request, as sent: each `event:` line names its data's type."""
    events, name = [], None
    with post(server, {**body, "stream": True}, stream=True) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
                assert events[-1]["type"] == name, (name, events[-1])
    return events


# one letter per event type: the order of a stream is a regular expression over them
LETTERS = {"response.created": "C", "response.in_progress": "P",
           "response.output_item.added": "A", "response.content_part.added": "[",
           "response.output_text.delta": "t", "response.output_text.done": "T",
           "response.content_part.done": "]", "response.function_call_arguments.delta": "f",
           "response.function_call_arguments.done": "F", "response.output_item.done": "D",
           "response.completed": "Z", "response.incomplete": "I"}
ORDER = re.compile(r"CP(A\[t*T\]D|AfFD)+[ZI]")


def check_stream(events: list[dict]) -> dict:
    """Order, numbering, shapes and ids of a raw event stream; returns the final response."""
    letters = "".join(LETTERS[e["type"]] for e in events)
    assert ORDER.fullmatch(letters), letters
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for e in events:
        EVENT.validate_python(e)           # the shapes openai-python's types define
    final = events[-1]["response"]
    Response.model_validate(final)
    assert {e["response"]["id"] for e in events if "response" in e} == {final["id"]}
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [i["id"] for i in added] == [i["id"] for i in done] == [i["id"] for i in
                                                                   final["output"]]
    assert done == final["output"]
    for e in events:
        if "item_id" in e:
            assert e["item_id"] == final["output"][e["output_index"]]["id"], e
    return final


# --------------------------------------------------------------------------- translation

def test_input_items_become_the_chat_messages_of_the_same_conversation():
    """Every item kind against `server.openai_messages` for the chat request a chat client
    would send: a text-and-call assistant turn, a tool turn, a developer turn, text parts."""
    from dflash2_mlx.server.responses_input import chat_messages, chat_tools, parse_request
    from dflash2_mlx.server.openai_routes import ChatRequest, openai_messages, openai_tools

    args = '{"city": "Paris"}'
    body = {"model": "m", "instructions": INSTRUCTIONS, "tools": [WEATHER], "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                     {"type": "input_text", "text": "in Paris?"}]},
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": [],
                      "logprobs": []}]},
        {"type": "function_call", "id": "fc_1", "status": "completed", "call_id": "c1",
         "name": "get_weather", "arguments": args},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": ""},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "rain"}]},
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": "And?"}]}
    chat = ChatRequest.model_validate({"model": "m", "tools": [CHAT_WEATHER], "messages": [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": args}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": "And?"}]})
    req = parse_request(body)
    assert chat_messages(req) == openai_messages(chat)
    assert chat_tools(req)[0] == openai_tools(chat)
    # a call with no assistant text before it is an assistant turn of its own
    alone = parse_request({"model": "m", "input": body["input"][2:3]})
    assert chat_messages(alone) == [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                      "arguments": {"city": "Paris"}}}]}]
    # tool_choice: "none" drops the tools; a named function is the only one offered
    other = {**WEATHER, "name": "get_time"}
    assert chat_tools(parse_request({**body, "tool_choice": "none"}))[0] is None
    named = parse_request({**body, "tools": [WEATHER, other],
                           "tool_choice": {"type": "function", "name": "get_time"}})
    assert [t["function"]["name"] for t in chat_tools(named)[0]] == ["get_time"]


# --------------------------------------------------------------------------- text

@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7}],
                         ids=["greedy", "seeded-T1"])
def test_same_conversation_same_text_as_chat_completions(oa, server, sampling):
    seed = {"seed": sampling["seed"]} if "seed" in sampling else {}
    chat = oa.chat.completions.create(model="llama", messages=CHAT_TURNS, max_tokens=24,
                                      temperature=sampling["temperature"], **seed)
    want = chat.choices[0].message.content
    r = oa.responses.create(model="llama", instructions=INSTRUCTIONS, input=TURNS,
                            max_output_tokens=24, temperature=sampling["temperature"],
                            extra_body=seed)
    Response.model_validate(r.to_dict())
    assert r.output_text == want
    assert [(o.type, o.role, [c.type for c in o.content]) for o in r.output] == \
        [("message", "assistant", ["output_text"])]
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    ext = r.usage.model_extra["dflash2"]
    assert ext["cached_tokens"] == r.usage.input_tokens_details.cached_tokens
    assert ext["cycles"] > 0 and ext["tau"] >= 1
    length = chat.choices[0].finish_reason == "length"
    assert r.status == ("incomplete" if length else "completed")
    assert (r.incomplete_details and r.incomplete_details.reason) == \
        ("max_output_tokens" if length else None)
    assert r.output[0].status == r.status
    assert r.instructions == INSTRUCTIONS and r.model == "llama"

    # streamed through the client's helper, and raw: the same text, the events in order
    with oa.responses.stream(model="llama", instructions=INSTRUCTIONS, input=TURNS,
                             max_output_tokens=24, temperature=sampling["temperature"],
                             extra_body=seed) as stream:
        events = list(stream)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == want and deltas[-1].snapshot == want
    assert events[-1].type == f"response.{r.status}"
    assert events[-1].response.output_text == want
    assert events[-1].response.usage.output_tokens == r.usage.output_tokens
    final = check_stream(raw_events(server, {
        "model": "llama", "instructions": INSTRUCTIONS, "input": TURNS,
        "max_output_tokens": 24, **sampling}))
    assert final["output"][0]["content"][0]["text"] == want


def test_a_string_input_a_cache_hit_and_max_output_tokens(oa):
    chat = oa.chat.completions.create(model="llama", max_tokens=3, temperature=0,
                                      messages=[{"role": "user", "content": "class Stack:"}])
    first = oa.responses.create(model="llama", input="class Stack:", max_output_tokens=3,
                                temperature=0)
    again = oa.responses.create(model="llama", input="class Stack:", max_output_tokens=3,
                                temperature=0)
    assert first.output_text == again.output_text == chat.choices[0].message.content
    # the second reuses the first's state: all of the prompt but what the cache must recompute
    assert again.usage.input_tokens_details.cached_tokens > 0
    assert first.usage.output_tokens == 3 and first.status == "incomplete"
    assert first.incomplete_details.reason == "max_output_tokens"
    # instructions are the system turn a developer message also gives
    a = oa.responses.create(model="llama", instructions=INSTRUCTIONS, input="class Stack:",
                            max_output_tokens=3, temperature=0)
    b = oa.responses.create(model="llama", max_output_tokens=3, temperature=0, input=[
        {"role": "developer", "content": INSTRUCTIONS},
        {"role": "user", "content": "class Stack:"}])
    assert a.usage.input_tokens == b.usage.input_tokens > first.usage.input_tokens
    assert a.output_text == b.output_text


# --------------------------------------------------------------------------- tools

@pytest.fixture(scope="module")
def tools(tools_dir, dflash2_dir):
    """A server on the target that always calls get_weather(city="Paris")."""
    s = Server("--model", tools_dir, "--draft", dflash2_dir, "--max-tokens", 32)
    yield s, openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
    assert s.stop() == 0, "".join(s.log)
    assert "Traceback" not in "".join(s.log), "".join(s.log)


def test_tool_round_trip_matches_chat_completions(tools):
    _, client = tools
    question = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.responses.create(model="tools", input=question, tools=[WEATHER],
                                max_output_tokens=16, temperature=0)
    Response.model_validate(r.to_dict())
    assert r.status == "completed" and r.output_text == ""
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id
    assert call.id.startswith("fc_") and call.status == "completed"
    assert r.tools[0].name == "get_weather" and r.tool_choice == "auto"
    chat = client.chat.completions.create(model="tools", messages=question, tools=[CHAT_WEATHER],
                                          max_tokens=16, temperature=0)
    assert r.usage.input_tokens == chat.usage.prompt_tokens     # the same prompt

    # turn 2: the call and its result go back with the conversation, as agents send them
    follow = client.responses.create(model="tools", tools=[WEATHER], max_output_tokens=16,
                                     temperature=0, input=question + r.output + [
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    chat_follow = client.chat.completions.create(
        model="tools", tools=[CHAT_WEATHER], max_tokens=16, temperature=0, messages=question + [
            {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function",
                                                  "function": {"name": call.name,
                                                               "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}])
    assert follow.usage.input_tokens == chat_follow.usage.prompt_tokens > r.usage.input_tokens
    assert follow.usage.input_tokens_details.cached_tokens > 0
    assert [(o.name, json.loads(o.arguments)) for o in follow.output] == \
        [(c.function.name, json.loads(c.function.arguments))
         for c in chat_follow.choices[0].message.tool_calls]

    # tool_choice "none" leaves the tools out of the prompt: the markers come back as text
    plain = client.responses.create(model="tools", input=question, tools=[WEATHER],
                                    tool_choice="none", max_output_tokens=16, temperature=0)
    assert plain.output_text == f"<tool_call>{TOOL_CALL}</tool_call>"
    assert plain.usage.input_tokens < r.usage.input_tokens


def test_tool_call_stream(tools):
    s, client = tools
    body = dict(model="tools", input="Weather in Paris?", tools=[WEATHER],
                max_output_tokens=16, temperature=0)
    with client.responses.stream(**body) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]
    (call,) = final.output
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    raw = check_stream(raw_events(s, body))
    assert raw["status"] == "completed" and raw["output"][0]["type"] == "function_call"


# --------------------------------------------------------------------------- what is refused

OK = {"model": "llama", "input": "hi", "max_output_tokens": 4}
LONG = "the quick brown fox " * 200                       # far beyond the context

REFUSED = [
    # (name, body, status, words the message must contain, param)
    ("stop: not in the Responses API", {**OK, "stop": ["x"]}, 400, "no stop strings", "stop"),
    ("an unknown field", {**OK, "frequency_penalty": 1}, 400, "unknown field",
     "frequency_penalty"),
    ("max_tokens", {**OK, "max_tokens": 4}, 400, "max_output_tokens", "max_tokens"),
    ("previous_response_id", {**OK, "previous_response_id": "resp_1"}, 400, "stores no",
     "previous_response_id"),
    ("store true", {**OK, "store": True}, 400, "store: true", "store"),
    ("conversation", {**OK, "conversation": "conv_1"}, 400, "stores no", "conversation"),
    ("background", {**OK, "background": True}, 400, "background", "background"),
    ("item reference", {**OK, "input": [{"type": "item_reference", "id": "msg_1"}]}, 400,
     "stored responses", "input.0.type"),
    ("an image part", {**OK, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://x/y.png"}]}]}, 400, "text-only",
     "input.0.content.0"),
    ("an unknown field in an item", {**OK, "input": [{"role": "user", "content": "x",
                                                      "color": "red"}]}, 400, "extra",
     "input.0.color"),
    ("bad role", {**OK, "input": [{"role": "robot", "content": "x"}]}, 400, "role",
     "input.0.role"),
    ("no input", {"model": "llama"}, 400, "required", "input"),
    ("empty input", {**OK, "input": []}, 400, "at least 1", "input"),
    ("arguments not JSON", {**OK, "input": [{"type": "function_call", "call_id": "c",
                                             "name": "f", "arguments": "{oops"}]}, 400,
     "not valid JSON", "input.0.arguments"),
    ("function_call_output without call_id", {**OK, "input": [
        {"type": "function_call_output", "output": "x"}]}, 400, "required", "input.0.call_id"),
    ("temperature wrong type", {**OK, "temperature": "hot"}, 400, "valid number",
     "temperature"),
    ("negative temperature", {**OK, "temperature": -1}, 400, "temperature", "temperature"),
    ("top_p 0", {**OK, "top_p": 0}, 400, "top_p", "top_p"),
    ("max_output_tokens 0", {**OK, "max_output_tokens": 0}, 400, "0 is not an integer >= 1",
     "max_output_tokens"),
    ("prompt longer than the context", {**OK, "input": LONG}, 400, "context", "input"),
    ("logprobs", {**OK, "include": ["message.output_text.logprobs"]}, 400,
     "reasoning.encrypted_content", "include.0"),
    ("top_logprobs", {**OK, "top_logprobs": 5}, 400, "0", "top_logprobs"),
    ("structured output", {**OK, "text": {"format": {"type": "json_schema", "name": "x",
                                                     "schema": {}}}}, 400, "'text'",
     "text.format.type"),
    ("truncation auto", {**OK, "truncation": "auto"}, 400, "disabled", "truncation"),
    ("tool_choice names no tool", {**OK, "tools": [WEATHER], "tool_choice": {
        "type": "function", "name": "get_time"}}, 400, "get_time", "tool_choice.name"),
    ("tool_choice required without tools", {**OK, "tool_choice": "required"}, 400,
     "no tools", "tool_choice"),
    ("hosted tool choice", {**OK, "tools": [WEATHER], "tool_choice": {"type": "web_search"}},
     400, "tool_choice", None),
    ("unknown model", {**OK, "model": "gpt-4o"}, 404, "does not exist", "model"),
]


def test_refused_fields_get_a_400_naming_them_and_the_server_recovers(server, oa):
    for name, body, status, words, param in REFUSED:
        r = post(server, body)
        assert r.status_code == status, (name, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, (name, err)
        if param is not None:
            assert err["param"] == param, (name, err)
            # the field is named (the context error speaks of the prompt as a whole)
            assert param in err["message"].lower() or err["code"] == "context_length_exceeded", \
                (name, err)
        assert words.lower() in err["message"].lower(), (name, err["message"])
    assert post(server, OK, key=None).status_code == 401
    assert post(server, OK, key="wrong").json()["error"]["code"] == "invalid_api_key"
    # accepted, as they ask for nothing this server does differently
    fine = {**OK, "store": False, "metadata": {"run": "1"}, "parallel_tool_calls": False,
            "include": ["reasoning.encrypted_content"], "text": {"format": {"type": "text"}},
            "truncation": "disabled", "user": "u", "prompt_cache_key": "k",
            "client_metadata": {"session": "s"}, "max_tool_calls": 3,
            "stream_options": None, "service_tier": "auto", "top_logprobs": 0}
    r = post(server, fine)
    assert r.status_code == 200, r.text
    assert r.json()["metadata"] == {"run": "1"} and r.json()["parallel_tool_calls"] is False
    # the real client raises the API's error with its message
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        oa.responses.create(model="llama", input="hi", previous_response_id="resp_1")
    want = oa.chat.completions.create(model="llama", max_tokens=6, temperature=0,
                                      messages=[{"role": "user", "content": "hi"}])
    got = oa.responses.create(model="llama", input="hi", max_output_tokens=6, temperature=0)
    assert got.output_text == want.choices[0].message.content
    assert server.health()["status"] == "ok"


def test_disconnect_mid_stream_cancels_then_next_request_works(server, oa):
    before = server.health()["cancelled"]
    body = {"model": "llama", "max_output_tokens": CAP, "temperature": 0, "stream": True,
            "input": "The quick brown fox"}
    with post(server, body, stream=True) as r:
        assert r.status_code == 200
        for line in r.iter_lines():                  # up to the first generated text
            if line == "event: response.output_text.delta":
                break
    deadline = time.time() + 20
    while (h := server.health())["cancelled"] == before or h["busy"]:
        assert time.time() < deadline, h
        time.sleep(0.05)
    r = oa.responses.create(model="llama", input="def add(a, b):", max_output_tokens=4,
                            temperature=0)
    assert r.usage.output_tokens == 4
