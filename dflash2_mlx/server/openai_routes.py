"""The OpenAI routes: GET /v1/models, POST /v1/chat/completions, POST /v1/completions."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..model.sampling import Sampling
from .errors import APIError, error_body
from .http import PING, Authorized, JSONRoute, ServiceDep, event_stream, sse
from .scheduler import GenerationRequest, Job
from .images import parts_of
from .schemas import ChatRequest, CompletionRequest, _OpenAISampling
from .service import Service, finish_reason, openai_tool_calls, usage
from .text_stream import TextStream
from .thinking import effort_switch

router = APIRouter(route_class=JSONRoute, dependencies=[Authorized])


def model_card(service: Service) -> dict:
    """The model, with its context length under the names vLLM (`max_model_len`) and LM Studio
    (`max_context_length`, `loaded_context_length`) use, and a plain `context_length`."""
    c = service.config
    return {"id": c.model_id, "object": "model", "created": 0, "owned_by": "dflash2-mlx",
            "context_length": c.context_length, "max_model_len": c.context_length,
            "max_context_length": c.context_length, "loaded_context_length": c.context_length,
            "max_output_tokens": c.max_tokens}


@router.get("/v1/models")
async def models(service: ServiceDep):
    return {"object": "list", "data": [model_card(service)]}


@router.get("/v1/models/{name:path}")
async def model(name: str, service: ServiceDep):
    service.check_model(name)
    return model_card(service)


def check_openai(service: Service, req: _OpenAISampling) -> None:
    """The model, and the fields this server knows but does not serve (never ignored)."""
    service.check_model(req.model)
    if req.n != 1:
        raise APIError(400, f"n = {req.n}: this server returns one choice per request "
                       "(n = 1)", param="n")
    refused = {"logprobs": req.logprobs, "top_logprobs": getattr(req, "top_logprobs", None),
               "suffix": getattr(req, "suffix", None),
               "best_of": (getattr(req, "best_of", None) or 1) > 1}
    for name, asked in refused.items():
        if asked:
            raise APIError(400, f"{name} is not supported by this server", param=name)


def openai_messages(req: ChatRequest) -> list[dict]:
    out = []
    for i, m in enumerate(req.messages):
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                               "content": parts_of(m.content, f"messages.{i}.content")}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if reasoning := m.reasoning_content or m.reasoning:
            msg["reasoning_content"] = reasoning     # the name Qwen's and GLM's templates read
        if m.tool_calls:
            calls = []
            for j, c in enumerate(m.tool_calls):
                args = c.function.arguments
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError:
                        raise APIError(400, f"messages.{i}.tool_calls.{j}.function.arguments "
                                       "is not valid JSON",
                                       param=f"messages.{i}.tool_calls") from None
                calls.append({"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": args}})
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def openai_tools(req: ChatRequest) -> list[dict] | None:
    if not req.tools or req.tool_choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]


def _include_usage(req: _OpenAISampling) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


@router.post("/v1/chat/completions")
async def chat(req: ChatRequest, request: Request, service: ServiceDep):
    check_openai(service, req)
    sampling = Sampling(req.temperature, req.top_p, req.top_k)
    stops = service.stops(req.stop)
    tools = openai_tools(req)
    prompt, media = service.render_chat(openai_messages(req), tools,
                                 template_args=req.chat_template_kwargs,
                                 thinking=effort_switch(req.reasoning_effort))
    asked, param = ((req.max_completion_tokens, "max_completion_tokens")
                    if req.max_completion_tokens is not None
                    else (req.max_tokens, "max_tokens"))
    limit = service.max_tokens(asked, len(prompt), param)
    job = service.submit(GenerationRequest(prompt, limit, sampling, req.seed,
                                           service.checkpoint(prompt), media))
    text = service.tool_stream(stops, tools, prompt)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
            "model": service.config.model_id}
    if req.stream:
        return event_stream(_chat_chunks(service, job, text, head, _include_usage(req)))
    content, reasoning, calls, final = [], [], [], None
    async for pieces, final in service.run(job, text, request):
        for p in pieces:
            if p.kind == "tool":
                calls.extend(p.calls)
            else:
                (content if p.kind == "text" else reasoning).append(p.text)
    if final is None:
        return JSONResponse({}, 499)      # the client left; nobody reads this
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
    if reasoning:
        message.update(_reasoning("".join(reasoning)))
    if calls:
        message["tool_calls"] = openai_tool_calls(calls, 0, False)
    return {**head, "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": finish_reason(final, text)}],
            "usage": usage(final, text)}


def _reasoning(text: str) -> dict:
    """The reasoning under both names clients read: `reasoning_content` (vLLM, DeepSeek) and
    `reasoning` (mlx-lm's server, OpenRouter)."""
    return {"reasoning_content": text, "reasoning": text}


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request, service: ServiceDep):
    check_openai(service, req)
    if req.echo:
        raise APIError(400, "echo is not supported by this server", param="echo")
    sampling = Sampling(req.temperature, req.top_p, req.top_k)
    stops = service.stops(req.stop)
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], str):
        if len(p) != 1:
            raise APIError(400, "prompt: give one prompt (a list of prompts would need "
                           "n > 1 choices)", param="prompt")
        p = p[0]
    if not p:
        raise APIError(400, "prompt is empty", param="prompt")
    try:
        prompt = service.pipe.encode(p, chat_template=False)
    except ValueError as e:
        why = str(e)           # the settings validator already names the prompt
        raise APIError(400, why if why.startswith("prompt") else f"prompt: {why}",
                       param="prompt") from None
    limit = service.max_tokens(req.max_tokens, len(prompt), prompt_param="prompt")
    job = service.submit(GenerationRequest(prompt, limit, sampling, req.seed))
    text = TextStream(stops)
    head = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
            "model": service.config.model_id, "object": "text_completion"}
    if req.stream:
        return event_stream(_completion_chunks(service, job, text, head, _include_usage(req)))
    out, final = [], None
    async for pieces, final in service.run(job, text, request):
        out.extend(p.text for p in pieces)
    if final is None:
        return JSONResponse({}, 499)
    return {**head, "choices": [{"index": 0, "text": "".join(out), "logprobs": None,
                                 "finish_reason": finish_reason(final, text)}],
            "usage": usage(final)}


async def _chat_chunks(service: Service, job: Job, text: TextStream, head: dict,
                       include_usage: bool) -> AsyncIterator[str]:
    base = {**head, "object": "chat.completion.chunk"}
    extra = {"usage": None} if include_usage else {}

    def chunk(delta: dict, finish: str | None = None) -> str:
        return sse({**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish}], **extra})

    yield chunk({"role": "assistant", "content": ""})
    calls = 0
    try:
        async for pieces, final in service.run(job, text):
            if not pieces and final is None:
                yield PING
            for p in pieces:
                if p.kind == "text":
                    yield chunk({"content": p.text})
                elif p.kind == "reasoning":
                    yield chunk(_reasoning(p.text))
                else:
                    yield chunk({"tool_calls": openai_tool_calls(p.calls, calls, True)})
                    calls += len(p.calls)
            if final is not None:
                yield chunk({}, finish_reason(final, text))
                if include_usage:
                    yield sse({**base, "choices": [], "usage": usage(final, text)})
    except APIError as e:
        yield sse(error_body(e, False))
    yield sse("[DONE]")


async def _completion_chunks(service: Service, job: Job, text: TextStream, head: dict,
                             include_usage: bool) -> AsyncIterator[str]:
    extra = {"usage": None} if include_usage else {}

    def chunk(t: str, finish: str | None = None) -> str:
        return sse({**head, "choices": [{"index": 0, "text": t, "logprobs": None,
                                         "finish_reason": finish}], **extra})

    try:
        async for pieces, final in service.run(job, text):
            if not pieces and final is None:
                yield PING
            for p in pieces:
                yield chunk(p.text)
            if final is not None:
                yield chunk("", finish_reason(final, text))
                if include_usage:
                    yield sse({**head, "choices": [], "usage": usage(final)})
    except APIError as e:
        yield sse(error_body(e, False))
    yield sse("[DONE]")
