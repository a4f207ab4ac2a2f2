"""The requests real agent clients send, replayed against the app in process, streamed and not:
Claude Code, Codex (an unknown model's tools, and those of a known one: a custom `apply_patch`,
`tool_search`) and opencode, captured by benchmarks/agent_clients.py (tests/agent_requests/,
each body as sent). The texts in them are cut to `CUT` characters at replay (every field, role,
block and tool stays as sent): the tests' byte-level tokenizer makes ~75k tokens of Claude
Code's 78k characters. The target answers every prompt with a call to the client's own tool
and a prompt after a tool result with a reply (`write_tool_target`), so each client's round
trip runs as it would against a real model; a thinking target (`write_thinking_target`) does
the same after its reasoning, which each client gets as its API's reasoning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

import dflash2_mlx  # noqa: E402
from fixtures import drafter_args, write_drafter, write_tool_target  # noqa: E402
from test_server import in_process  # noqa: E402

REQUESTS = Path(__file__).parent / "agent_requests"
CUT = 160
REPLY = "Done."
CONTEXT = 65536
MAX_TOKENS = 64
# the call each client's target makes: its own tool, as the client names it in its tools
CALLS = {
    "claude-code": {"name": "Bash", "arguments": {"command": "echo hi", "description": "say hi"}},
    "codex": {"name": "multi_agent_v1__spawn_agent", "arguments": {"message": "say hi"}},
    "codex-gpt-5.5": {"name": "apply_patch",
                      "arguments": {"input": "*** Begin Patch\n*** End Patch"}},
    "opencode": {"name": "bash", "arguments": {"command": "echo hi"}},
}


def cut(x, key: str | None = None):
    """Texts cut to CUT characters; an image's data (base64, a data: URL) kept whole."""
    if isinstance(x, str):
        return x if key == "data" or x.startswith("data:") else x[:CUT]
    if isinstance(x, list):
        return [cut(v) for v in x]
    if isinstance(x, dict):
        return {k: cut(v, k) for k, v in x.items()}
    return x


def replayed(name: str) -> list[dict]:
    """The client's requests in order, texts cut, the model renamed to the server's."""
    out = []
    for f in sorted(REQUESTS.glob(f"{name}-[0-9].json")):
        r = json.loads(f.read_text())
        body = cut(r["body"])
        body["model"] = "llama"
        out.append({**r, "body": body})
    assert out, name
    return out


@pytest.fixture(scope="module")
def agent_pipes(tmp_path_factory):
    """A one-layer, one-head tool caller per client (long prompts prefill in seconds)."""
    root = tmp_path_factory.mktemp("agents")
    draft = write_drafter(root / "draft", drafter_args(layer_ids=(0,), num_target_layers=1))
    pipes = {}
    for name, call in CALLS.items():
        target = write_tool_target(root / name, json.dumps(call, separators=(",", ":")),
                                   reply=REPLY, num_hidden_layers=1, num_attention_heads=1,
                                   num_key_value_heads=1, max_position_embeddings=CONTEXT)
        pipes[name] = dflash2_mlx.load(str(target), str(draft))
    return pipes


def sse_events(text: str) -> list[tuple[str | None, dict | str]]:
    """(event name, data) of an SSE body; comments (pings) left out."""
    out, event = [], None
    for line in text.split("\n"):
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
            out.append((event, data if data == "[DONE]" else json.loads(data)))
            event = None
    return out


def run(pipe, requests: list[dict], **config) -> list[tuple[httpx.Response, httpx.Response]]:
    """Each request streamed, then again not streamed (the prefix cache then holds its prompt)."""
    async def clients(app, http, go):
        go.set()
        out = []
        for r in requests:
            headers = {k: v for k, v in r["headers"].items() if k != "accept"}
            pair = []
            for stream in (True, False):
                pair.append(await http.post(r["path"], json={**r["body"], "stream": stream},
                                            headers=headers))
            out.append(tuple(pair))
        return out

    return in_process(pipe, clients, **{"context_length": CONTEXT, "max_tokens": MAX_TOKENS,
                                        **config})


def test_claude_code_turns_stream_to_message_stop_and_round_trip_its_tool(agent_pipes):
    first, second = run(agent_pipes["claude-code"], replayed("claude-code"))
    for streamed, plain in (first, second):
        assert streamed.status_code == plain.status_code == 200, (streamed.text, plain.text)
        # the client asks for 32000 tokens: clamped, and the response says to what
        assert streamed.headers["x-dflash2-max-tokens"] == str(MAX_TOKENS)
        events = sse_events(streamed.text)
        kinds = [e for e, _ in events]
        assert "error" not in kinds and kinds[0] == "message_start" and \
            kinds[-1] == "message_stop", kinds
        start = events[0][1]["message"]["usage"]
        assert {"input_tokens", "cache_read_input_tokens"} <= set(start)
        delta = next(d for e, d in events if e == "message_delta")
        # the replay of the same prompt reads all but its last token from the prefix cache
        again = plain.json()["usage"]
        prompt = again["input_tokens"] + again["cache_read_input_tokens"]
        assert again["cache_read_input_tokens"] == prompt - 1, again
        assert delta["usage"]["cache_read_input_tokens"] == start["cache_read_input_tokens"]
    use = [b for b in first[1].json()["content"] if b["type"] == "tool_use"]
    assert [(u["name"], u["input"]) for u in use] == [("Bash", CALLS["claude-code"]["arguments"])]
    assert first[1].json()["stop_reason"] == "tool_use"
    streamed_use = [d["content_block"]["name"] for e, d in sse_events(first[0].text)
                    if e == "content_block_start" and d["content_block"]["type"] == "tool_use"]
    assert streamed_use == ["Bash"]
    reply = second[1].json()
    assert reply["content"] == [{"type": "text", "text": REPLY}] and \
        reply["stop_reason"] == "end_turn"


def test_a_new_claude_code_session_reuses_its_prompt_from_the_cache(agent_pipes):
    """The billing block (x-anthropic-billing-header: cc_version=...) differs every session;
    left out of the prompt, a second session's prompt is read from the prefix cache."""
    (first,) = replayed("claude-code")[:1]
    second = json.loads(json.dumps(first))
    billing = second["body"]["system"][0]
    assert billing["text"].startswith("x-anthropic-billing-header:")
    billing["text"] = billing["text"].replace("cc_version=", "cc_version=9.9.9.abc; cch=1f2e;")
    second["body"]["metadata"] = {"user_id": "another session"}
    def second_session(**config) -> dict:
        """The usage the second session's first (streamed) request reports."""
        _, (streamed, _) = run(agent_pipes["claude-code"], [first, second], **config)
        return next(d for e, d in sse_events(streamed.text) if e == "message_delta")["usage"]

    usage = second_session()
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert usage["cache_read_input_tokens"] >= 0.9 * prompt, usage
    # kept on request: then the prompts differ from the billing block on (this template
    # writes the tools first, so the block is ~18k tokens in)
    kept = second_session(keep_billing_header=True)
    assert kept["input_tokens"] + kept["cache_read_input_tokens"] > prompt
    assert kept["cache_read_input_tokens"] < usage["cache_read_input_tokens"] - 10, kept


def test_codex_turns_complete_with_namespace_calls_routed_back(agent_pipes):
    first, second = run(agent_pipes["codex"], replayed("codex"))
    for streamed, plain in (first, second):
        assert streamed.status_code == plain.status_code == 200, (streamed.text, plain.text)
        assert streamed.headers["x-dflash2-ignored-tools"] == "web_search"
        kinds = [e for e, _ in sse_events(streamed.text)]
        assert "error" not in kinds and "response.failed" not in kinds, kinds
        assert kinds[-1] == "response.completed", kinds
    calls = [i for i in first[1].json()["output"] if i["type"] == "function_call"]
    assert [(c["name"], c.get("namespace"), json.loads(c["arguments"])) for c in calls] == \
        [("spawn_agent", "multi_agent_v1", CALLS["codex"]["arguments"])]
    done = [d["item"] for e, d in sse_events(first[0].text) if e == "response.output_item.done"]
    assert [(i["name"], i["namespace"]) for i in done] == [("spawn_agent", "multi_agent_v1")]
    (message,) = second[1].json()["output"]
    assert message["content"][0]["text"] == REPLY


def test_codex_custom_tools_come_back_as_custom_tool_calls(agent_pipes):
    first, second = run(agent_pipes["codex-gpt-5.5"], replayed("codex-gpt-5.5"))
    for streamed, plain in (first, second):
        assert streamed.status_code == plain.status_code == 200, (streamed.text, plain.text)
        assert set(streamed.headers["x-dflash2-ignored-tools"].split(",")) == \
            {"tool_search", "web_search"}
        assert sse_events(streamed.text)[-1][0] == "response.completed"
    (call,) = first[1].json()["output"]
    assert call["type"] == "custom_tool_call" and call["name"] == "apply_patch"
    assert call["input"] == CALLS["codex-gpt-5.5"]["arguments"]["input"]
    kinds = [e for e, _ in sse_events(first[0].text)]
    assert "response.custom_tool_call_input.delta" in kinds
    assert second[1].json()["output"][0]["content"][0]["text"] == REPLY


def test_opencode_turns_and_its_tool_round_trip(agent_pipes):
    title, main, result = run(agent_pipes["opencode"], replayed("opencode"))
    for streamed, plain in (title, main, result):
        assert streamed.status_code == plain.status_code == 200, (streamed.text, plain.text)
        assert sse_events(streamed.text)[-1][1] == "[DONE]"
        usage = [d["usage"] for _, d in sse_events(streamed.text)[:-1] if d.get("usage")]
        assert usage and usage[-1]["dflash2"]["max_tokens"] == MAX_TOKENS   # asked 32000
    (call,) = main[1].json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "bash"
    assert json.loads(call["function"]["arguments"]) == CALLS["opencode"]["arguments"]
    assert result[1].json()["choices"][0]["message"]["content"] == REPLY


def test_context_overflow_is_worded_as_each_api_words_it(agent_pipes):
    """Claude Code compacts on Anthropic's wording; Codex on `context_length_exceeded` in a
    response.failed event; count_tokens says how long a prompt is."""
    pipe = agent_pipes["claude-code"]
    (claude,) = replayed("claude-code")[:1]
    (codex,) = replayed("codex")[:1]
    codex = {**codex, "body": {**codex["body"], "model": "llama"}}

    async def clients(app, http, go):
        go.set()
        count = await http.post("/v1/messages/count_tokens", json=claude["body"])
        messages = await http.post("/v1/messages", json=claude["body"])
        stream = await http.post("/v1/responses", json={**codex["body"], "stream": True})
        plain = await http.post("/v1/responses", json={**codex["body"], "stream": False})
        head = await http.head("/")
        return count, messages, stream, plain, head

    count, messages, stream, plain, head = in_process(pipe, clients, context_length=2048)
    n = count.json()["input_tokens"]
    assert n > 2048
    assert messages.status_code == 400
    err = messages.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"] == f"prompt is too long: {n} tokens > 2047 maximum"
    assert stream.status_code == 200
    failed = sse_events(stream.text)[-1]
    assert failed[0] == "response.failed"
    assert failed[1]["response"]["error"]["code"] == "context_length_exceeded"
    assert plain.status_code == 400
    assert plain.json()["error"]["code"] == "context_length_exceeded"
    assert head.status_code == 200


# --------------------------------------------------------------------------- a thinking target

THOUGHT = "\nThe command ran.\n"          # the reasoning of the reply after a tool result


@pytest.fixture(scope="module")
def thinking_pipes(tmp_path_factory):
    """Per client, a one-layer thinker (`write_thinking_target`): its reasoning, `</think>`,
    an answer and a call to the client's tool; after a tool result, THOUGHT then REPLY."""
    from dflash2_mlx.testing import write_thinking_target

    root = tmp_path_factory.mktemp("thinking-agents")
    draft = write_drafter(root / "draft", drafter_args(layer_ids=(0,), num_target_layers=1))
    pipes = {}
    for name, call in CALLS.items():
        target = write_thinking_target(
            root / name, call=json.dumps(call, separators=(",", ":")),
            reply=THOUGHT + "</think>" + REPLY, num_hidden_layers=1, num_attention_heads=1,
            num_key_value_heads=1, max_position_embeddings=CONTEXT)
        pipes[name] = dflash2_mlx.load(str(target), str(draft))
    return pipes


@pytest.mark.slow  # 31 s
def test_claude_code_on_a_thinking_target_gets_thinking_blocks(thinking_pipes):
    from dflash2_mlx.testing import ANSWER, REASONING

    first, second = run(thinking_pipes["claude-code"], replayed("claude-code"))
    for (streamed, plain), kinds in ((first, ["thinking", "text", "tool_use"]),
                                     (second, ["thinking", "text"])):
        assert streamed.status_code == plain.status_code == 200, (streamed.text, plain.text)
        events = sse_events(streamed.text)
        assert events[-1][0] == "message_stop", events[-3:]
        assert [d["content_block"]["type"] for e, d in events
                if e == "content_block_start"] == kinds
        assert [b["type"] for b in plain.json()["content"]] == kinds
    thinking, text, use = first[1].json()["content"]
    assert (thinking["thinking"], text["text"], use["name"]) == (REASONING, ANSWER, "Bash")
    assert use["input"] == CALLS["claude-code"]["arguments"]
    thinking, text = second[1].json()["content"]
    assert (thinking["thinking"], text["text"]) == (THOUGHT, REPLY)


@pytest.mark.slow  # 7 s
@pytest.mark.parametrize("client", ["codex", "codex-gpt-5.5"])
def test_codex_on_a_thinking_target_gets_reasoning_items(thinking_pipes, client):
    from dflash2_mlx.testing import ANSWER, REASONING

    call = "custom_tool_call" if client == "codex-gpt-5.5" else "function_call"
    first, second = run(thinking_pipes[client], replayed(client))
    for (streamed, plain), kinds in ((first, ["reasoning", "message", call]),
                                     (second, ["reasoning", "message"])):
        assert streamed.status_code == plain.status_code == 200, (streamed.text, plain.text)
        events = sse_events(streamed.text)
        assert events[-1][0] == "response.completed", events[-3:]
        assert [d["item"]["type"] for e, d in events if e == "response.output_item.done"] == \
            kinds
        assert [i["type"] for i in plain.json()["output"]] == kinds
    reasoning, message, made = first[1].json()["output"]
    assert reasoning["content"][0]["text"] == REASONING
    assert message["content"][0]["text"] == ANSWER
    assert made["name"] == CALLS[client]["name"].split("__")[-1]
    reasoning, message = second[1].json()["output"]
    assert (reasoning["content"][0]["text"], message["content"][0]["text"]) == (THOUGHT, REPLY)


def test_opencode_on_a_thinking_target_gets_reasoning_content(thinking_pipes):
    from dflash2_mlx.testing import ANSWER, REASONING

    title, main, result = run(thinking_pipes["opencode"], replayed("opencode"))
    for streamed, plain in (title, main, result):
        assert streamed.status_code == plain.status_code == 200, (streamed.text, plain.text)
        assert sse_events(streamed.text)[-1][1] == "[DONE]"
    for (streamed, plain), (thought, answer) in ((main, (REASONING, ANSWER)),
                                                 (result, (THOUGHT, REPLY))):
        message = plain.json()["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == (thought, answer)
        deltas = [d["choices"][0]["delta"] for _, d in sse_events(streamed.text)[:-1]
                  if d.get("choices")]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == thought
        assert "".join(d.get("content") or "" for d in deltas) == answer
    (call,) = main[1].json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "bash"


@pytest.mark.slow      # 30 s: Claude Code's and Codex's prompts, twice each
def test_each_clients_image_request_runs_to_its_end(tmp_path):
    """An image from each client, as each sent it (benchmarks/agent_clients.py's `image`
    scenario): Claude Code's `Read` of a PNG (an image block in a tool_result), Codex's
    `--image` (a Responses `input_image` between its <image> tags), opencode's attached file
    (an `image_url` data URL), on a vision-language target: each streams to its terminal
    event and answers unstreamed; the replay of the same request reads its prompt, the image's
    rows included, from the prefix cache."""
    import vision_fixtures as vf

    pytest.importorskip("mlx_vlm")
    pipe = dflash2_mlx.load(str(vf.write_vlm(tmp_path / "qwen2_vl", "qwen2_vl")), "none")
    # (Codex samples at the Responses API's default temperature: complete, or cut at its limit)
    ends = {"claude-code": ("message_stop",), "codex": ("response.completed",
                                                        "response.incomplete"),
            "opencode": None}
    for client, end in ends.items():
        (request,) = replayed(f"{client}-image")
        ((streamed, plain),) = run(pipe, [request])
        assert streamed.status_code == plain.status_code == 200, (client, streamed.text,
                                                                  plain.text)
        events = sse_events(streamed.text)
        assert "error" not in [e for e, _ in events], (client, events[-3:])
        assert events[-1][0] in end if end else events[-1][1] == "[DONE]", events[-1]
        body = plain.json()
        usage = body["usage"]
        if client == "claude-code":
            cached, prompt = usage["cache_read_input_tokens"], usage["input_tokens"] + \
                usage["cache_read_input_tokens"]
        elif client == "codex":
            cached, prompt = usage["input_tokens_details"]["cached_tokens"], \
                usage["input_tokens"]
        else:
            cached, prompt = usage["prompt_tokens_details"]["cached_tokens"], \
                usage["prompt_tokens"]
        assert cached == prompt - 1, (client, usage)
