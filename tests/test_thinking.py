"""Thinking models: the reasoning split from the answer (`server.thinking`), in every API,
streamed and not, switched per request and server-wide, on a tiny thinking target
(`write_thinking_target`: a Qwen3-like template that opens `<think>` in the generation prompt,
and weights that write a set reasoning, `</think>`, a set answer and, where asked, a tool
call). The splitter's own tests run on the fixture tokenizer's real ids."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

import dflash2_mlx  # noqa: E402
from dflash2_mlx.server.chat_prompt import parse_tool_call  # noqa: E402
from dflash2_mlx.server.text_stream import TextStream  # noqa: E402
from dflash2_mlx.server.thinking import Markers, ThinkingSplit, effort_switch  # noqa: E402
from dflash2_mlx.testing import ANSWER, REASONING, write_thinking_target  # noqa: E402
from test_server import in_process  # noqa: E402

CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """The thinking target (it calls get_weather after its answer), loaded without drafter."""
    folder = write_thinking_target(tmp_path_factory.mktemp("thinker") / "think",
                                   call=json.dumps(CALL, separators=(",", ":")))
    return dflash2_mlx.load(str(folder), None)


def split_all(split: ThinkingSplit, tok, ids: list[int], by_char: bool = False):
    """(reasoning, answer) of the ids, detokenized one token at a time (by_char: each
    delta fed a character at a time, so markers arrive in pieces)."""
    detok = tok.detokenizer
    detok.reset()
    out = {True: "", False: ""}
    for t in ids:
        detok.add_token(t)
        delta = detok.last_segment
        for i, part in enumerate(delta if by_char else [delta]):
            for reasoning, text in split.feed(part, [t] if i == 0 else []):
                out[reasoning] += text
    for reasoning, text in split.finish():
        out[reasoning] += text
    return out[True], out[False]


# --------------------------------------------------------------------------- the splitter

def test_markers_and_the_prompt_that_opens_the_block(thinker):
    tok = thinker.tokenizer
    markers = Markers.of(tok)
    assert (markers.start, markers.end) == ("<think>", "</think>")
    on = tok.apply_chat_template(HI, add_generation_prompt=True)
    off = tok.apply_chat_template(HI, add_generation_prompt=True, enable_thinking=False)
    assert markers.opens_in(on) and not markers.opens_in(off)
    assert not markers.opens_in(tok.encode("hi"))


@pytest.mark.parametrize("by_char", [False, True])
def test_split_from_inside_and_from_a_block_the_model_opens(thinker, by_char):
    tok = thinker.tokenizer
    markers = Markers.of(tok)
    ids = tok.encode(REASONING + "</think>" + ANSWER, add_special_tokens=False)
    split = ThinkingSplit(markers, inside=True)
    assert split_all(split, tok, ids, by_char) == (REASONING, ANSWER)
    assert split.reasoning_tokens == ids.index(markers.end_ids[0]) + 1
    # a template that leaves <think> to the model (Qwen3's): the block opens in the output
    ids = tok.encode("<think>" + REASONING + "</think>" + ANSWER, add_special_tokens=False)
    split = ThinkingSplit(markers, inside=False)
    assert split_all(split, tok, ids, by_char) == (REASONING, ANSWER)
    assert split.reasoning_tokens == ids.index(markers.end_ids[0]) + 1
    # never closed (max_tokens in the middle of the reasoning): all of it is reasoning
    ids = tok.encode(REASONING + "</thi", add_special_tokens=False)
    assert split_all(ThinkingSplit(markers, inside=True), tok, ids, by_char) == \
        (REASONING + "</thi", "")


def test_a_tool_call_inside_the_reasoning_is_not_a_call(thinker):
    tok = thinker.tokenizer
    call = "<tool_call>" + json.dumps(CALL) + "</tool_call>"
    ids = tok.encode("I could write " + call + " here.</think>Fine." + call,
                     add_special_tokens=False)
    detok = tok.detokenizer
    detok.reset()
    text = TextStream(["here"], ("<tool_call>", "</tool_call>"),
                      lambda t: parse_tool_call(t, TOOLS),
                      thinking=ThinkingSplit(Markers.of(tok), inside=True))
    pieces = []
    for t in ids:
        detok.add_token(t)
        pieces += text.feed(detok.last_segment, [t])
    pieces += text.finish()
    # the stop string "here" is looked for in the answer only
    kinds = []
    for p in pieces:
        if kinds and kinds[-1][0] == p.kind:
            kinds[-1] = (p.kind, kinds[-1][1] + p.text)
        else:
            kinds.append((p.kind, p.text))
    assert kinds == [("reasoning", "I could write " + call + " here."), ("text", "Fine."),
                     ("tool", "")]
    assert [p.calls for p in pieces if p.kind == "tool"] == [[CALL]]
    assert text.stopped is None and text.made_tool_call


def test_efforts_and_template_args():
    from dflash2_mlx import settings

    assert [effort_switch(e) for e in (None, "none", "minimal", "low", "high")] == \
        [None, False, False, True, True]
    assert settings.chat_template_args('{"enable_thinking": false}') == \
        {"enable_thinking": False}
    for bad in ("{bad", "[1]", {"tokenize": True}):
        with pytest.raises(settings.SettingError, match="chat_template_args"):
            settings.chat_template_args(bad)


# --------------------------------------------------------------------------- OpenAI chat

def sse_data(text: str) -> list:
    return [json.loads(line[6:]) for line in text.split("\n")
            if line.startswith("data: ") and line != "data: [DONE]"]


def chat(thinker, bodies: list[dict], **config) -> list[httpx.Response]:
    async def clients(app, http, go):
        go.set()
        return [await http.post("/v1/chat/completions", json={"model": "llama",
                                                             "max_tokens": 32, **b})
                for b in bodies]
    return in_process(thinker, clients, **config)


def test_openai_chat_splits_reasoning_streamed_and_not(thinker):
    plain, streamed = chat(thinker, [{"messages": HI, "tools": TOOLS},
                                     {"messages": HI, "tools": TOOLS, "stream": True,
                                      "stream_options": {"include_usage": True}}])
    body = plain.json()
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == message["reasoning"] == REASONING
    assert message["content"] == ANSWER
    (call,) = message["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == CALL["arguments"]
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    # <think> is the prompt's; the reasoning and </think> are 2 of the 7 tokens (the answer,
    # <tool_call>, the call, </tool_call>, <|im_end|>)
    assert body["usage"]["completion_tokens"] == 7
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 2
    chunks = sse_data(streamed.text)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == REASONING
    assert "".join(d.get("reasoning", "") for d in deltas) == REASONING
    assert "".join(d.get("content", "") for d in deltas) == ANSWER
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", [])] == \
        ["get_weather"]
    assert chunks[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] == 2


def test_openai_switches_turn_thinking_off(thinker):
    """reasoning_effort "none", chat_template_kwargs and --chat-template-args give the prompt
    an empty block: the answer comes alone; a request's switch goes over the server's."""
    effort, kwargs, on = chat(thinker, [
        {"messages": HI, "reasoning_effort": "none"},
        {"messages": HI, "chat_template_kwargs": {"enable_thinking": False}},
        {"messages": HI, "reasoning_effort": "high",
         "chat_template_kwargs": {"enable_thinking": True}}])
    for r in (effort, kwargs):
        message = r.json()["choices"][0]["message"]
        assert message["content"].startswith(ANSWER) and "reasoning_content" not in message
        assert r.json()["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    assert on.json()["choices"][0]["message"]["reasoning_content"] == REASONING
    off, low = chat(thinker, [{"messages": HI}, {"messages": HI, "reasoning_effort": "low"}],
                    chat_template_args={"enable_thinking": False})
    assert "reasoning" not in off.json()["choices"][0]["message"]
    assert low.json()["choices"][0]["message"]["reasoning"] == REASONING
    (refused,) = chat(thinker, [{"messages": HI, "chat_template_kwargs": {"tools": []}}])
    assert refused.status_code == 400 and "chat_template_kwargs" in refused.text


# --------------------------------------------------------------------------- Anthropic

def post(thinker, path: str, bodies: list[dict], **config) -> list[httpx.Response]:
    async def clients(app, http, go):
        go.set()
        return [await http.post(path, json={"model": "llama", **b}) for b in bodies]
    return in_process(thinker, clients, **config)


def sse_events(text: str) -> list[tuple[str, dict]]:
    out, event = [], None
    for line in text.split("\n"):
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: ") and line != "data: [DONE]":
            out.append((event, json.loads(line[6:])))
    return out


ANTHROPIC_TOOLS = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]


def test_anthropic_thinking_blocks_streamed_and_not(thinker):
    body = {"max_tokens": 32, "messages": HI, "tools": ANTHROPIC_TOOLS,
            "thinking": {"type": "adaptive"}}
    plain, streamed, off = post(thinker, "/v1/messages", [
        body, {**body, "stream": True}, {**body, "thinking": {"type": "disabled"}}])
    thinking, text, use = plain.json()["content"]
    assert thinking["type"] == "thinking" and thinking["thinking"] == REASONING
    assert thinking["signature"]
    assert text == {"type": "text", "text": ANSWER}
    assert (use["type"], use["name"], use["input"]) == ("tool_use", "get_weather",
                                                        CALL["arguments"])
    assert plain.json()["stop_reason"] == "tool_use"
    events = sse_events(streamed.text)
    starts = [d["content_block"]["type"] for e, d in events if e == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    deltas = [d["delta"] for e, d in events if e == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == REASONING
    assert [d["signature"] for d in deltas if d["type"] == "signature_delta"] == \
        [thinking["signature"]]
    assert "".join(d.get("text", "") for d in deltas) == ANSWER
    assert events[-1][0] == "message_stop"
    assert [b["type"] for b in off.json()["content"]] == ["text", "tool_use"]


# --------------------------------------------------------------------------- Responses

def test_responses_reasoning_items_streamed_and_not(thinker):
    body = {"input": "hi", "tools": [{"type": "function", **TOOLS[0]["function"]}],
            "include": ["reasoning.encrypted_content"]}
    plain, streamed, off = post(thinker, "/v1/responses", [
        body, {**body, "stream": True}, {**body, "reasoning": {"effort": "none"}}])
    reasoning, message, call = plain.json()["output"]
    assert reasoning["type"] == "reasoning" and reasoning["summary"] == []
    assert reasoning["content"] == [{"type": "reasoning_text", "text": REASONING}]
    assert reasoning["encrypted_content"]
    assert message["content"][0]["text"] == ANSWER
    assert (call["type"], call["name"]) == ("function_call", "get_weather")
    assert plain.json()["usage"]["output_tokens_details"]["reasoning_tokens"] == 2
    events = sse_events(streamed.text)
    kinds = [e for e, _ in events]
    assert "".join(d["delta"] for e, d in events if e == "response.reasoning_text.delta") == \
        REASONING
    assert kinds.index("response.reasoning_text.done") < kinds.index(
        "response.output_text.delta")
    done = [d["item"]["type"] for e, d in events if e == "response.output_item.done"]
    assert done == ["reasoning", "message", "function_call"]
    assert kinds[-1] == "response.completed"
    final = events[-1][1]["response"]
    assert final["output"][0]["content"] == reasoning["content"]
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 2
    assert [i["type"] for i in off.json()["output"]] == ["message", "function_call"]


# --------------------------------------------------------------------------- prefix reuse

# a system prompt of a few hundred tokens, as agents send (theirs are thousands)
SYSTEM = " ".join(["You are a small assistant. Print the answer, then stop."] * 30)


def three_turns(pipe, api: str, max_tokens: int = 32) -> list[tuple[int, int]]:
    """A three-turn conversation on `api`, each answer sent back as that API's clients send
    it (the reasoning included) -> (cached, prompt) tokens of each turn."""
    async def clients(app, http, go):
        go.set()
        turns, history = [], []
        for ask in ("hi", "and then?", "thanks"):
            if api == "openai":
                history.append({"role": "user", "content": ask})
                r = (await http.post("/v1/chat/completions", json={
                    "model": "llama", "max_tokens": max_tokens, "messages": [
                        {"role": "system", "content": SYSTEM}, *history]})).json()
                m = r["choices"][0]["message"]
                history.append({"role": "assistant", "content": m["content"],
                                **({"reasoning_content": m["reasoning_content"]}
                                   if "reasoning_content" in m else {})})
                cached, prompt = (r["usage"]["prompt_tokens_details"]["cached_tokens"],
                                  r["usage"]["prompt_tokens"])
            elif api == "anthropic":
                history.append({"role": "user", "content": ask})
                r = (await http.post("/v1/messages", json={
                    "model": "llama", "max_tokens": max_tokens, "system": SYSTEM,
                    "thinking": {"type": "enabled", "budget_tokens": 1024},
                    "messages": history})).json()
                history.append({"role": "assistant", "content": r["content"]})
                cached = r["usage"]["cache_read_input_tokens"]
                prompt = cached + r["usage"]["input_tokens"]
            else:
                history.append({"role": "user", "content": ask})
                r = (await http.post("/v1/responses", json={
                    "model": "llama", "max_output_tokens": max_tokens, "instructions": SYSTEM,
                    "input": history, "include": ["reasoning.encrypted_content"]})).json()
                history.extend(r["output"])
                cached, prompt = (r["usage"]["input_tokens_details"]["cached_tokens"],
                                  r["usage"]["input_tokens"])
            turns.append((cached, prompt))
        return turns
    return in_process(pipe, clients)


@pytest.mark.parametrize("api", ["openai", "anthropic", "responses"])
def test_later_turns_read_their_prompt_from_the_prefix_cache(thinker, api):
    """The template drops the earlier turns' reasoning sent back: the next prompt parts from
    the cached turn where its block opened, and reads all before it from the cache."""
    turns = three_turns(thinker, api)
    print(api, [f"{c}/{p} = {c / p:.1%}" for c, p in turns[1:]])
    assert turns[0][0] == 0
    for cached, prompt in turns[1:]:
        assert cached >= 0.9 * prompt, turns


@pytest.mark.slow  # 10 s
def test_a_hybrid_thinker_reads_later_turns_from_its_checkpoint(tmp_path):
    """A target with recurrent layers cannot trim its cached turn back to where the next
    prompt parts from it: the state kept at the block's start serves it."""
    from test_families import CONFIGS

    cfg = {k: v for k, v in CONFIGS["qwen3_5"].items() if k != "model_type"}
    folder = write_thinking_target(tmp_path / "hybrid", family="qwen3_5", **cfg)
    turns = three_turns(dflash2_mlx.load(str(folder), None), "anthropic", max_tokens=8)
    print("qwen3_5", [f"{c}/{p} = {c / p:.1%}" for c, p in turns[1:]])
    for cached, prompt in turns[1:]:
        assert cached >= 0.9 * prompt, turns


# --------------------------------------------------------------------------- history

def test_reasoning_sent_back_reaches_the_template(thinker):
    """Each API's way of sending a turn's reasoning back becomes the assistant message's
    `reasoning_content`; the template renders it inside a tool round trip and drops it
    once a new user query follows."""
    from dflash2_mlx.server.anthropic_routes import anthropic_messages
    from dflash2_mlx.server.openai_routes import openai_messages
    from dflash2_mlx.server.responses_input import chat_messages, parse_request, seal
    from dflash2_mlx.server.schemas import ChatRequest, MessagesRequest

    use = {"id": "call_1", "name": "get_weather", "input": CALL["arguments"]}
    anthropic = anthropic_messages(MessagesRequest.model_validate({
        "model": "llama", "max_tokens": 8, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": REASONING, "signature": "x"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "tool_use", **use}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                          "content": "sunny"}]}]}))
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": json.dumps(CALL["arguments"])}
    out = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
    responses = [chat_messages(parse_request({"model": "llama", "input": [
        {"role": "user", "content": "hi"}, item, call, out]})) for item in (
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": REASONING}]},
        # Codex sends the item back without its text: this server's sealed copy
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": seal(REASONING)})]
    openai = openai_messages(ChatRequest.model_validate({"model": "llama", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "reasoning_content": REASONING,
         "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "get_weather", "arguments": json.dumps(CALL["arguments"])}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]}))
    block = "<think>\n" + REASONING.strip("\n") + "\n</think>"
    tok = thinker.tokenizer
    for messages in (anthropic, *responses, openai):
        assert messages[1]["role"] == "assistant"
        assert messages[1]["reasoning_content"] == REASONING
        rendered = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                           add_generation_prompt=True)
        assert block in rendered
        later = messages + [{"role": "assistant", "content": "It is sunny."},
                            {"role": "user", "content": "thanks"}]
        assert block not in tok.apply_chat_template(later, tools=TOOLS, tokenize=False,
                                                    add_generation_prompt=True)


# --------------------------------------------------------------------------- mlx-lm's server

def mlx_lm_server(model: str):
    """`mlx_lm.server` on the model, on a free loopback port -> (process, url) once it
    answers."""
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "mlx_lm.server", "--model", model,
                             "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            httpx.get(url + "/v1/models", timeout=2)
            return proc, url
        except httpx.TransportError:
            assert proc.poll() is None and time.time() < deadline, "mlx_lm.server did not start"
            time.sleep(0.3)


@pytest.mark.server
@pytest.mark.slow  # 8 s
def test_the_split_matches_mlx_lm_server(tmp_path):
    """The same chat requests, greedy, to mlx-lm's server and to ours, both real processes on
    the thinking target: the same reasoning, the same answer and the same tool calls, with
    thinking on, off (chat_template_kwargs) and streamed. With tools offered only: mlx-lm
    parses a call without them too, this server leaves it in the text."""
    from fixtures import Server

    folder = write_thinking_target(tmp_path / "think",
                                   call=json.dumps(CALL, separators=(",", ":")))
    bodies = [{"messages": HI, "tools": TOOLS},
              {"messages": HI, "tools": TOOLS,
               "chat_template_kwargs": {"enable_thinking": False}},
              {"messages": HI, "tools": TOOLS, "stream": True}]
    ours = Server("--model", folder)
    theirs, url = mlx_lm_server(str(folder))
    try:
        got = {}
        for name, base, model in (("ours", ours.url, "think"), ("mlx-lm", url, str(folder))):
            got[name] = [said(httpx.post(base + "/v1/chat/completions", timeout=60, json={
                "model": model, "max_tokens": 32, "temperature": 0, **b}), b.get("stream"))
                for b in bodies]
    finally:
        theirs.terminate()
        theirs.wait(30)
        assert ours.stop() == 0, "".join(ours.log)
    assert got["ours"] == got["mlx-lm"]
    made = [("get_weather", CALL["arguments"])]
    assert got["ours"] == [(REASONING, ANSWER, made), ("", ANSWER, made),
                           (REASONING, ANSWER, made)]


def said(r: httpx.Response, stream: bool) -> tuple[str, str, list]:
    """(reasoning, answer, [(tool, arguments)]) of a chat response, streamed or not."""
    assert r.status_code == 200, r.text
    parts = ([c["choices"][0]["delta"] for c in sse_data(r.text) if c.get("choices")]
             if stream else [r.json()["choices"][0]["message"]])
    calls = [c["function"] for p in parts for c in p.get("tool_calls") or []]
    return ("".join(p.get("reasoning") or "" for p in parts),
            "".join(p.get("content") or "" for p in parts),
            [(c["name"], json.loads(c["arguments"])) for c in calls])
