"""The Anthropic route: POST /v1/messages (text, tool use, streaming events)."""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..model.sampling import Sampling
from ..model.vision import Media
from .errors import APIError, error_body
from .http import PING, Authorized, JSONRoute, ServiceDep, event_stream, sse
from .scheduler import GenerationRequest, Job
from .images import anthropic_image, content_of, parts_of
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
    prompt, media = render(service, req, tools)
    limit = service.max_tokens(req.max_tokens, len(prompt), anthropic=True)
    job = service.submit(GenerationRequest(prompt, limit, sampling, None,
                                           service.checkpoint(prompt), media))
    text = service.tool_stream(stops, tools, prompt)
    head = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
            "model": service.config.model_id}
    headers = service.headers(limit, left_out)
    if req.stream:
        return event_stream(_anthropic_events(service, job, text, head, len(prompt)), headers)
    blocks: list[dict] = []
    final = None
    async for pieces, final in service.run(job, text, request):
        for p in pieces:
            field = {"text": "text", "reasoning": "thinking"}.get(p.kind)
            if field is None:
                blocks.extend(_tool_use(c) for c in p.calls)
            elif blocks and blocks[-1]["type"] == field:
                blocks[-1][field] += p.text
            else:
                blocks.append({"type": field, field: p.text})
    if final is None:
        return JSONResponse({}, 499)      # the client left; nobody reads this
    for b in blocks:
        if b["type"] == "thinking":
            b["signature"] = signature(b["thinking"])
    reason, seq = _stop_reason(final, text)
    return JSONResponse({**head, "content": blocks, "stop_reason": reason, "stop_sequence": seq,
                         "usage": _anthropic_usage(final)}, headers=headers)


@router.post("/v1/messages/count_tokens")
async def count_tokens(req: CountTokensRequest, service: ServiceDep):
    """The prompt's tokens as this server renders it (tools and system turns included)."""
    service.check_model(req.model)
    tools, _ = anthropic_tools(req)
    return {"input_tokens": len(render(service, req, tools)[0])}


def render(service: Service, req: CountTokensRequest, tools: list[dict] | None
           ) -> tuple[list[int], Media | None]:
    """The prompt ids and images (`Service.render_chat`), with the request's thinking switch
    (`thinking.type`)."""
    return service.render_chat(anthropic_messages(req, service.config.keep_billing_header),
                               tools, thinking=None if req.thinking is None else req.thinking.on)


def signature(thinking: str) -> str:
    """A thinking block's `signature`: the API requires one, clients send it back with the
    block. Here a digest of the text (nothing checks it: the block is read as it comes)."""
    return hashlib.sha256(thinking.encode()).hexdigest()[:32]


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
    an assistant turn's thinking blocks as its `reasoning_content` (the field Qwen's and GLM's
    templates read; a template that drops earlier reasoning drops it), redacted_thinking
    blocks left out, tool_result blocks as tool turns."""
    out: list[dict] = []
    if system := _system_blocks(req, keep_billing_header):
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text, calls, thinking = [], [], []          # text: internal parts (images.py)
        for j, b in enumerate(m.content):
            where = f"messages.{i}.content.{j}"
            if b.type == "text":
                text.append({"type": "text", "text": b.text or ""})
            elif b.type == "image" and m.role == "user":
                if b.source is None:
                    raise APIError(400, f"{where}: an image block needs a source", param=where)
                text.append(anthropic_image(b.source, where))
            elif b.type == "thinking" and m.role == "assistant" and b.thinking:
                thinking.append(b.thinking)
            elif b.type in ("thinking", "redacted_thinking"):
                continue
            elif m.role == "system" or b.type == "image":
                raise APIError(400, f"{where}: a {m.role} turn holds no {b.type} block"
                               if b.type == "image" else
                               f"{where}: a system turn holds text blocks only",
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
                            "content": parts_of(b.content, f"{where}.content")})
        if text or calls or thinking:
            msg: dict[str, Any] = {"role": m.role, "content": content_of(text)}
            if thinking:
                msg["reasoning_content"] = "\n\n".join(thinking)
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
    index, started = 0, False
    block: dict | None = None          # the text or thinking block open, as built so far
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
                kind = {"text": "text", "reasoning": "thinking"}.get(p.kind)
                if block is not None and block["type"] != kind:
                    for event in _close(block, index):
                        yield event
                    index, block = index + 1, None
                if kind is not None:
                    if block is None:
                        block = {"type": kind, kind: ""}
                        start = {**block, **({"signature": ""} if kind == "thinking" else {})}
                        yield sse({"type": "content_block_start", "index": index,
                                   "content_block": start}, "content_block_start")
                    block[kind] += p.text
                    yield sse({"type": "content_block_delta", "index": index,
                               "delta": {"type": f"{kind}_delta", kind: p.text}},
                              "content_block_delta")
                    continue
                for call in p.calls:
                    use = _tool_use(call)
                    yield sse({"type": "content_block_start", "index": index,
                               "content_block": {**use, "input": {}}}, "content_block_start")
                    yield sse({"type": "content_block_delta", "index": index,
                               "delta": {"type": "input_json_delta",
                                         "partial_json": json.dumps(use["input"])}},
                              "content_block_delta")
                    yield sse({"type": "content_block_stop", "index": index},
                              "content_block_stop")
                    index += 1
            if final is not None:
                if block is not None:
                    for event in _close(block, index):
                        yield event
                reason, seq = _stop_reason(final, text)
                out = _anthropic_usage(final)
                out.pop("dflash2")
                yield sse({"type": "message_delta",
                           "delta": {"stop_reason": reason, "stop_sequence": seq},
                           "usage": out}, "message_delta")
                yield sse({"type": "message_stop"}, "message_stop")
    except APIError as e:
        yield sse(error_body(e, True), "error")


def _close(block: dict, index: int) -> list[str]:
    """The events that end a streamed text or thinking block (a thinking block's signature
    comes last, as a signature_delta)."""
    out = []
    if block["type"] == "thinking":
        out.append(sse({"type": "content_block_delta", "index": index, "delta": {
            "type": "signature_delta", "signature": signature(block["thinking"])}},
            "content_block_delta"))
    return out + [sse({"type": "content_block_stop", "index": index}, "content_block_stop")]
