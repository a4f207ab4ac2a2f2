"""The Anthropic route: POST /v1/messages (text, tool use, streaming events)."""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..sampling import Sampling
from .errors import APIError, error_body
from .http import PING, Authorized, JSONRoute, ServiceDep, event_stream, sse
from .scheduler import GenerationRequest, Job
from .schemas import MessagesRequest, content_text
from .service import Service, usage
from .text_stream import TextStream

router = APIRouter(route_class=JSONRoute, dependencies=[Authorized])


@router.post("/v1/messages")
async def messages(req: MessagesRequest, request: Request, service: ServiceDep):
    service.check_model(req.model)
    sampling = Sampling(req.temperature, req.top_p, req.top_k)
    stops = service.stops(req.stop_sequences)
    tools = anthropic_tools(req)
    prompt = service.render_chat(anthropic_messages(req), tools)
    limit = service.max_tokens(req.max_tokens, len(prompt))
    job = service.submit(GenerationRequest(prompt, limit, sampling, None))
    text = service.tool_stream(stops, tools)
    head = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
            "model": service.config.model_id}
    if req.stream:
        return event_stream(_anthropic_events(service, job, text, head, len(prompt)))
    blocks: list[dict] = []
    final = None
    async for pieces, final in service.run(job, text, request):
        for p in pieces:
            if p.kind == "text" and blocks and blocks[-1]["type"] == "text":
                blocks[-1]["text"] += p.text
            elif p.kind == "text":
                blocks.append({"type": "text", "text": p.text})
            else:
                blocks.extend(_tool_use(c) for c in p.calls)
    if final is None:
        return JSONResponse({}, 499)      # the client left; nobody reads this
    reason, seq = _stop_reason(final, text)
    return {**head, "content": blocks, "stop_reason": reason, "stop_sequence": seq,
            "usage": _anthropic_usage(final)}


def anthropic_messages(req: MessagesRequest) -> list[dict]:
    out: list[dict] = []
    if req.system:
        out.append({"role": "system", "content": content_text(req.system)})
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text, calls = [], []
        for j, b in enumerate(m.content):
            where = f"messages.{i}.content.{j}"
            if b.type == "text":
                text.append(b.text or "")
            elif b.type == "tool_use":
                if m.role != "assistant" or not b.name:
                    raise APIError(400, f"{where}: a tool_use block belongs to an assistant "
                                   "turn and needs a name", param=where)
                calls.append({"id": b.id, "type": "function",
                              "function": {"name": b.name, "arguments": b.input or {}}})
            else:   # tool_result: a tool message, as chat templates expect
                if m.role != "user":
                    raise APIError(400, f"{where}: a tool_result block belongs to a user turn",
                                   param=where)
                out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                            "content": content_text(b.content)})
        if text or calls:
            msg: dict[str, Any] = {"role": m.role, "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def anthropic_tools(req: MessagesRequest) -> list[dict] | None:
    if not req.tools or (req.tool_choice is not None and req.tool_choice.type == "none"):
        return None
    return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.input_schema}}
            for t in req.tools]


def _tool_use(call: dict) -> dict:
    args = call.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            args = {"arguments": args}
    return {"type": "tool_use", "id": call.get("id") or f"toolu_{uuid.uuid4().hex[:24]}",
            "name": call["name"], "input": args}


def _stop_reason(final: dict, text: TextStream) -> tuple[str, str | None]:
    if text.stopped is not None:
        return "stop_sequence", text.stopped
    if text.made_tool_call:
        return "tool_use", None
    return ("max_tokens" if final["done"] == "length" else "end_turn"), None


def _anthropic_usage(final: dict) -> dict:
    figures = usage(final)
    return {"input_tokens": final["prompt_tokens"] - final["cached_tokens"],
            "output_tokens": figures["completion_tokens"],
            "cache_read_input_tokens": final["cached_tokens"],
            "cache_creation_input_tokens": 0, "dflash2": figures["dflash2"]}


async def _anthropic_events(service: Service, job: Job, text: TextStream, head: dict,
                            prompt_tokens: int) -> AsyncIterator[str]:
    yield sse({"type": "message_start", "message": {
        **head, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}}, "message_start")
    index, open_text = 0, False
    try:
        async for pieces, final in service.run(job, text):
            if not pieces and final is None:
                yield PING
            for p in pieces:
                if p.kind == "text":
                    if not open_text:
                        yield sse({"type": "content_block_start", "index": index,
                                   "content_block": {"type": "text", "text": ""}},
                                  "content_block_start")
                        open_text = True
                    yield sse({"type": "content_block_delta", "index": index,
                               "delta": {"type": "text_delta", "text": p.text}},
                              "content_block_delta")
                    continue
                if open_text:
                    yield sse({"type": "content_block_stop", "index": index},
                              "content_block_stop")
                    index, open_text = index + 1, False
                for call in p.calls:
                    block = _tool_use(call)
                    yield sse({"type": "content_block_start", "index": index,
                               "content_block": {**block, "input": {}}}, "content_block_start")
                    yield sse({"type": "content_block_delta", "index": index,
                               "delta": {"type": "input_json_delta",
                                         "partial_json": json.dumps(block["input"])}},
                              "content_block_delta")
                    yield sse({"type": "content_block_stop", "index": index},
                              "content_block_stop")
                    index += 1
            if final is not None:
                if open_text:
                    yield sse({"type": "content_block_stop", "index": index},
                              "content_block_stop")
                reason, seq = _stop_reason(final, text)
                out = _anthropic_usage(final)
                yield sse({"type": "message_delta",
                           "delta": {"stop_reason": reason, "stop_sequence": seq},
                           "usage": {"output_tokens": out["output_tokens"]}},
                          "message_delta")
                yield sse({"type": "message_stop"}, "message_stop")
    except APIError as e:
        yield sse(error_body(e, True), "error")

