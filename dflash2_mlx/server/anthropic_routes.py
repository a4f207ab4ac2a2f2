"""The Anthropic route: POST /v1/messages (text, tool use, streaming events)."""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..decode.sampling import Sampling
from .errors import APIError, error_body
from .http import PING, Authorized, JSONRoute, ServiceDep, event_stream, sse
from .scheduler import GenerationRequest, Job
from .schemas import CountTokensRequest, MessagesRequest, content_text
from .service import Service, usage
from .text_stream import TextStream

router = APIRouter(route_class=JSONRoute, dependencies=[Authorized])


@router.post("/v1/messages")
async def messages(req: MessagesRequest, request: Request, service: ServiceDep):
    service.check_model(req.model)
    sampling = Sampling(req.temperature, req.top_p, req.top_k)
    stops = service.stops(req.stop_sequences)
    tools, left_out = anthropic_tools(req)
    prompt = service.render_chat(anthropic_messages(req, service.config.keep_billing_header),
                                 tools)
    limit = service.max_tokens(req.max_tokens, len(prompt), anthropic=True)
    job = service.submit(GenerationRequest(prompt, limit, sampling, None))
    text = service.tool_stream(stops, tools)
    head = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
            "model": service.config.model_id}
    headers = service.headers(limit, left_out)
    if req.stream:
        return event_stream(_anthropic_events(service, job, text, head, len(prompt)), headers)
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
    return JSONResponse({**head, "content": blocks, "stop_reason": reason, "stop_sequence": seq,
                         "usage": _anthropic_usage(final)}, headers=headers)


@router.post("/v1/messages/count_tokens")
async def count_tokens(req: CountTokensRequest, service: ServiceDep):
    """The prompt's tokens as this server renders it (tools and system turns included)."""
    service.check_model(req.model)
    tools, _ = anthropic_tools(req)
    prompt = service.render_chat(anthropic_messages(req, service.config.keep_billing_header),
                                 tools)
    return {"input_tokens": len(prompt)}


BILLING_HEADER = "x-anthropic-billing-header:"


def _system_blocks(req: CountTokensRequest, keep_billing_header: bool) -> str:
    """The `system` field's text; Claude Code's per-session billing block left out unless
    kept (`--keep-billing-header`)."""
    if isinstance(req.system, list) and not keep_billing_header:
        return content_text([b for b in req.system if not b.text.startswith(BILLING_HEADER)])
    return content_text(req.system)


def anthropic_messages(req: CountTokensRequest, keep_billing_header: bool = False
                       ) -> list[dict]:
    """The conversation as chat messages (OpenAI shape): `system` first, a system turn where
    it stands (`Service.render_chat` folds it into the first where the template needs it),
    thinking blocks left out, tool_result blocks as tool turns."""
    out: list[dict] = []
    if system := _system_blocks(req, keep_billing_header):
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text, calls = [], []
        for j, b in enumerate(m.content):
            where = f"messages.{i}.content.{j}"
            if b.type == "text":
                text.append(b.text or "")
            elif b.type in ("thinking", "redacted_thinking"):
                continue
            elif m.role == "system":
                raise APIError(400, f"{where}: a system turn holds text blocks only",
                               param=where)
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


def anthropic_tools(req: CountTokensRequest) -> tuple[list[dict] | None, list[str]]:
    """The client tools in the chat template's shape, and the names of Anthropic's own tool
    types (web search, code execution, ...) left out: this server cannot run them."""
    if not req.tools or (req.tool_choice is not None and req.tool_choice.type == "none"):
        return None, []
    client = [t for t in req.tools if t.type in (None, "custom")]
    left_out = [t.name for t in req.tools if t.type not in (None, "custom")]
    return [{"type": "function", "function": {
        "name": t.name, "description": t.description or "", "parameters": t.input_schema}}
        for t in client] or None, left_out


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


def _prompt_usage(prompt_tokens: int, cached: int) -> dict:
    """Anthropic's input counts: input_tokens are those not read from the cache."""
    return {"input_tokens": prompt_tokens - cached, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0, "output_tokens": 0}


def _anthropic_usage(final: dict) -> dict:
    figures = usage(final)
    return {**_prompt_usage(final["prompt_tokens"], final["cached_tokens"]),
            "output_tokens": figures["completion_tokens"], "dflash2": figures["dflash2"]}


async def _anthropic_events(service: Service, job: Job, text: TextStream, head: dict,
                            prompt_tokens: int) -> AsyncIterator[str]:
    """message_start goes out when the job reaches the model, with the prompt tokens read from
    the prefix cache (until then, keep-alive comments; after it, ping events, as Anthropic
    sends them through a long wait)."""
    index, open_text, started = 0, False, False
    try:
        async for pieces, final in service.run(job, text):
            if not started and job.cached_tokens is not None:
                started = True
                yield sse({"type": "message_start", "message": {
                    **head, "content": [], "stop_reason": None, "stop_sequence": None,
                    "usage": _prompt_usage(prompt_tokens, job.cached_tokens)}},
                    "message_start")
            elif not pieces and final is None:
                # Anthropic's own keep-alive event, as its API sends it through a long wait
                yield sse({"type": "ping"}, "ping") if started else PING
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
                out.pop("dflash2")
                yield sse({"type": "message_delta",
                           "delta": {"stop_reason": reason, "stop_sequence": seq},
                           "usage": out}, "message_delta")
                yield sse({"type": "message_stop"}, "message_stop")
    except APIError as e:
        yield sse(error_body(e, True), "error")

