"""`Service`: what both APIs share between a checked request and its response: the checks of
model, lengths and stop strings, rendering messages into prompt ids, submitting the job and
turning its events into `Piece`s; and the usage and tool-call shapes of the OpenAI answers."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import AsyncIterator

from fastapi import Request

from .. import log as logs
from ..pipeline import Pipeline
from .config import ServerConfig
from .errors import APIError
from .scheduler import SHUTDOWN, GenerationRequest, Job, QueueFull, Scheduler, ShuttingDown
from .text_stream import Piece, TextStream

log = logs.get(__name__)

MAX_STOPS = 16
# the acceptance figures of a request, reported as usage["dflash2"] (GenerationStats.to_dict)
USAGE_STATS = ("block_size", "tau", "cycles", "steps", "plain_steps", "mean_width",
               "cycles_drafter", "tau_drafter", "cycles_lookup", "tau_lookup",
               "cached_tokens", "prefill_s", "decode_s", "decode_tps")


class Service:
    """Turns checked requests into jobs and jobs into response pieces; shared by both APIs."""

    def __init__(self, pipe: Pipeline, config: ServerConfig, scheduler: Scheduler):
        self.pipe, self.config, self.scheduler = pipe, config, scheduler
        tok = pipe.tokenizer
        self.has_template = bool(getattr(tok, "has_chat_template", tok.chat_template))
        self.tool_markers = ((tok.tool_call_start, tok.tool_call_end)
                             if getattr(tok, "has_tool_calling", False) else None)

    # ---- checks shared by the routes
    def check_model(self, name: str) -> None:
        if name != self.config.model_id:
            raise APIError(404, f"The model '{name}' does not exist; this server serves "
                           f"'{self.config.model_id}' (see GET /v1/models)", param="model",
                           code="model_not_found")

    def max_tokens(self, asked: int | None, prompt_len: int, param: str = "max_tokens", *,
                   prompt_param: str = "messages") -> int:
        """The tokens to generate: `asked` (the field `param`), checked against the server's
        limit and the room the prompt (the field `prompt_param`) leaves in the context."""
        c = self.config
        if prompt_len >= c.context_length:
            raise APIError(400, f"the prompt has {prompt_len} tokens; this model's context is "
                           f"{c.context_length} tokens", param=prompt_param,
                           code="context_length_exceeded")
        room = c.context_length - prompt_len
        if asked is None:
            return min(c.max_tokens, room)
        if asked > c.max_tokens:
            raise APIError(400, f"{param} = {asked} is above this server's limit of "
                           f"{c.max_tokens}", param=param)
        if asked > room:
            raise APIError(400, f"this model's context is {c.context_length} tokens; the "
                           f"prompt has {prompt_len} and {param} asks for {asked} more "
                           f"(at most {room})", param=param, code="context_length_exceeded")
        return asked

    def stops(self, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise APIError(400, f"stop: give at most {MAX_STOPS} non-empty strings",
                           param="stop")
        return stops

    # ---- prompts
    def render_chat(self, messages: list[dict], tools: list[dict] | None,
                    param: str = "messages") -> list[int]:
        """Messages (OpenAI shape, content as a string) -> prompt ids, through the model's
        chat template exactly as `Pipeline.encode` renders one user message. param: the
        request's field that holds the messages (named by a refusal)."""
        tok = self.pipe.tokenizer
        if not self.has_template:
            text = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages)
            return tok.encode(text + "assistant:")
        try:
            text = tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                           add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - a template's own refusal (jinja raise_exception)
            raise APIError(400, f"the chat template refused these messages: {e}",
                           param=param) from None
        return tok.encode(text, add_special_tokens=False)

    def tool_stream(self, stops: list[str], tools: list[dict] | None) -> TextStream:
        if tools and self.tool_markers:
            parser = self.pipe.tokenizer.tool_parser
            return TextStream(stops, self.tool_markers, lambda text: parser(text, tools))
        return TextStream(stops)

    # ---- running
    def submit(self, req: GenerationRequest) -> Job:
        try:
            return self.scheduler.submit(req, asyncio.get_running_loop())
        except QueueFull:
            raise APIError(429, f"the server is busy: {self.config.queue_size} requests are "
                           "already waiting; retry later", kind="rate_limit_error",
                           code="queue_full") from None
        except ShuttingDown:
            raise APIError(503, SHUTDOWN, kind="server_error") from None

    async def run(self, job: Job, text: TextStream, request: Request | None = None
                  ) -> AsyncIterator[tuple[list[Piece], dict | None]]:
        """(pieces, None) per cycle, then ([], final event); an error event raises APIError.

        Streaming (no `request`): also ([], None) after every `ping_interval` seconds without
        an event, for the stream to send a keep-alive ping. Non-streaming (`request`): the
        client's connection is checked at every event and every 0.5 s between them, and the
        job cancelled once it closed (the generator then ends without a final event). The job
        is also cancelled if the consumer stops early (a streaming client left) and when a stop
        string ends the text."""
        wait = self.config.ping_interval if request is None else 0.5
        try:
            while True:
                try:
                    event = await asyncio.wait_for(job.events.get(), wait)
                except asyncio.TimeoutError:
                    event = None
                if request is not None and await request.is_disconnected():
                    log.info("client disconnected: generation cancelled")
                    return
                if event is None:
                    if request is None:
                        yield [], None
                    continue
                if "error" in event:
                    raise APIError(event.get("status", 500), event["error"], kind="server_error")
                if "done" in event:
                    tail = text.finish()
                    if tail:
                        yield tail, None
                    job.cancel("done")
                    yield [], event
                    return
                pieces = text.feed(event["text"])
                if text.stopped is not None:
                    job.cancel("stop")
                if pieces:
                    yield pieces, None
        finally:
            job.cancel()


def finish_reason(event: dict, text: TextStream) -> str:
    if text.stopped is not None:
        return "stop"
    if text.made_tool_call:
        return "tool_calls"
    return "length" if event["done"] == "length" else "stop"


def usage(event: dict) -> dict:
    stats = event["stats"]
    completion = stats.get("generated_tokens", 0)
    return {"prompt_tokens": event["prompt_tokens"], "completion_tokens": completion,
            "total_tokens": event["prompt_tokens"] + completion,
            "prompt_tokens_details": {"cached_tokens": event["cached_tokens"]},
            "dflash2": {k: stats.get(k) for k in USAGE_STATS if k in stats}}


def openai_tool_calls(calls: list[dict], start: int, streaming: bool) -> list[dict]:
    out = []
    for i, c in enumerate(calls):
        args = c.get("arguments", {})
        out.append({**({"index": start + i} if streaming else {}),
                    "id": c.get("id") or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                    "function": {"name": c["name"], "arguments": args if isinstance(args, str)
                                 else json.dumps(args, ensure_ascii=False)}})
    return out

