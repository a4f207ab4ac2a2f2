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
from .. import settings as check
from ..model.vision import Media
from ..pipeline import Pipeline
from .chat_prompt import TOOL_MARKERS, TemplateTraits, fold_system, parse_tool_call, tools_in_text
from .config import ServerConfig
from .errors import APIError
from .images import decode_images, take_images, tool_images_after
from .scheduler import (SHUTDOWN, GenerationRequest, Job, NeverFits, QueueFull, Scheduler,
                        ShuttingDown)
from .text_stream import Piece, TextStream
from .thinking import Markers, ThinkingSplit, switch

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
        self.markers = Markers.of(tok)          # None: the model writes no reasoning block
        self.traits = TemplateTraits(self._template if self.has_template else None)
        if self.traits.tools and getattr(tok, "has_tool_calling", False):
            self.tool_markers, self.tool_parser = ((tok.tool_call_start, tok.tool_call_end),
                                                   tok.tool_parser)
        elif self.traits.tools:          # the template renders tools but has no known markers
            self.tool_markers, self.tool_parser = None, None
        else:                            # tools go in the prompt, in the Hermes format
            self.tool_markers, self.tool_parser = TOOL_MARKERS, parse_tool_call

    # ---- checks shared by the routes
    def check_model(self, name: str) -> None:
        if name != self.config.model_id:
            raise APIError(404, f"The model '{name}' does not exist; this server serves "
                           f"'{self.config.model_id}' (see GET /v1/models)", param="model",
                           code="model_not_found")

    def max_tokens(self, asked: int | None, prompt_len: int, param: str = "max_tokens", *,
                   prompt_param: str = "messages", anthropic: bool = False) -> int:
        """The tokens to generate: `asked` (the field `param`; None: as many as allowed)
        clamped to the server's `--max-tokens` and to the room the prompt leaves in the
        context, as hosted APIs' compatible servers do (agents ask for 32k whatever the model).
        The context is the shorter of `--context-length` and what the memory budget holds
        for one sequence. A prompt that fills it is a 400 worded as the called API words a
        context overflow, which is what agents match on to compact their conversation (with
        the budget's numbers and the flags that help, when the budget is the limit)."""
        c = self.config
        fit = self.scheduler.fit          # the most tokens the memory budget holds (or None)
        length = c.context_length if fit is None else min(c.context_length, fit)
        room = length - prompt_len
        if room < 1:
            memory = length < c.context_length
            message = (f"prompt is too long: {prompt_len} tokens > {length - 1} maximum"
                       if anthropic else
                       f"This model's maximum context length is {length} tokens. "
                       f"However, your messages resulted in {prompt_len} tokens. Please reduce "
                       "the length of the messages.")
            if memory:        # worded as the context's limit: agents compact on these words
                message += (" (The limit is this server's memory budget: "
                            f"{self.scheduler.memory.too_long(prompt_len + 1)}.)")
            raise APIError(400, message, param=prompt_param, code="context_length_exceeded")
        given = min(c.max_tokens, room, asked or c.max_tokens)
        if asked is not None and given < asked:
            log.info(f"{param} = {asked} clamped to {given} (--max-tokens {c.max_tokens}, "
                     f"{room} tokens of context left after the prompt"
                     f"{' in the memory budget' if length < c.context_length else ''})")
        return given

    @staticmethod
    def headers(max_tokens: int, left_out: list[str] = ()) -> dict[str, str]:
        """What the server made of the request, for the client to see: the tokens it may
        generate (after clamping) and the hosted tools it left out of the prompt."""
        if left_out:
            log.info(f"tools left out of the prompt (this server cannot run them): "
                     f"{', '.join(left_out)}")
        return {"x-dflash2-max-tokens": str(max_tokens),
                **({"x-dflash2-ignored-tools": ",".join(left_out)} if left_out else {})}

    def stops(self, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise APIError(400, f"stop: give at most {MAX_STOPS} non-empty strings",
                           param="stop")
        return stops

    # ---- prompts
    def render_chat(self, messages: list[dict], tools: list[dict] | None,
                    param: str = "messages", template_args: dict | None = None,
                    thinking: bool | None = None) -> tuple[list[int], Media | None]:
        """Messages (OpenAI shape, content a string or, with images, a list of internal parts:
        `images`) -> (prompt ids, its images or None), through the model's chat template
        exactly as `Pipeline.encode` renders one user message (with images, each image's rows
        as key ids: `Pipeline.encode_images`). param: the
        request's field that holds the messages (named by a refusal); template_args: the
        thinking: the request's thinking switch (None: the server's `--chat-template-args`),
        over those; template_args: the request's own template arguments (OpenAI's
        `chat_template_kwargs`), over both."""
        tok = self.pipe.tokenizer
        taken = sorted(set(template_args or {}) & set(check.TEMPLATE_OWN_ARGS))
        if taken:
            raise APIError(400, f"chat_template_kwargs: {', '.join(taken)} are set by the "
                           "server, not by a request", param="chat_template_kwargs")
        messages, sources = take_images(tool_images_after(messages))
        if sources:
            self._check_images(messages, sources[0].where)
            messages = self.pipe.vision.escaped(messages)
        if not self.traits.system_anywhere:
            messages = fold_system(messages)
        if not self.traits.tools:
            messages, tools = tools_in_text(messages, tools), None
        if not self.has_template:
            text = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages)
            return tok.encode(text + "assistant:"), None
        try:
            text = self._template(messages, tools=tools,
                                  **{**switch(thinking), **(template_args or {})})
        except Exception as e:  # noqa: BLE001 - a template's own refusal (jinja raise_exception)
            raise APIError(400, f"the chat template refused these messages: {e}",
                           param=param) from None
        if not sources:
            return tok.encode(text, add_special_tokens=False), None
        images = decode_images(sources, self.config.image_limits, self.config.fetch_images)
        try:
            media = self.pipe.vision.media(text, images)
        except ValueError as e:
            raise APIError(400, f"{param}: {e}", param=param) from None
        return media.keys, media

    def _check_images(self, messages: list[dict], param: str) -> None:
        """400 where this model takes no images, or an image is outside a user turn; param:
        the first image's field."""
        why = self.pipe.image_refusal()
        if why is not None:
            raise APIError(400, f"{param}: {why}", param=param)
        if not self.has_template:
            raise APIError(400, f"{param}: images need the model's chat template, and this "
                           "model has none", param=param)
        for i, m in enumerate(messages):
            if m["role"] != "user" and isinstance(m.get("content"), list):
                raise APIError(400, f"{param}: an image in a {m['role']} turn (turn {i}); "
                               "images go in user turns and tool results", param=param)

    def _template(self, messages: list[dict], tools: list[dict] | None, **args) -> str:
        args = {**self.config.chat_template_args, **args}
        return self.pipe.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                       add_generation_prompt=True, **args)

    def checkpoint(self, prompt: list[int]) -> int | None:
        """Where the next turn's prompt may part from this one's prompt and output, for a
        thinking model: at the block its prompt opens (a template that drops earlier reasoning
        renders the answer there), else at its end. The prefix cache keeps a state there too
        when it cannot trim back to it (recurrent layers)."""
        if self.markers is None:
            return None
        if self.markers.opens_in(prompt):
            return self.markers.rfind_start(prompt)
        return len(prompt)

    def tool_stream(self, stops: list[str], tools: list[dict] | None,
                    prompt: list[int] | None = None) -> TextStream:
        """The response's text: reasoning split off (a chat `prompt` to a thinking model),
        stop strings cut, tool calls parsed from the answer (when tools were offered and the
        template's calls can be found)."""
        thinking = (ThinkingSplit(self.markers, self.markers.opens_in(prompt))
                    if self.markers is not None and prompt is not None else None)
        if not tools:
            return TextStream(stops, thinking=thinking)
        if self.tool_markers is None:
            raise APIError(400, "this model's chat template renders tools but mlx-lm knows no "
                           "parser for its tool calls: a request with tools cannot be served",
                           param="tools")
        parser = self.tool_parser
        return TextStream(stops, self.tool_markers, lambda text: parser(text, tools),
                          thinking=thinking)

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
        except NeverFits as e:
            raise APIError(400, f"out of memory: {e}", code="context_length_exceeded") from None

    async def run(self, job: Job, text: TextStream, request: Request | None = None
                  ) -> AsyncIterator[tuple[list[Piece], dict | None]]:
        """(pieces, None) per cycle, then ([], final event); an error event raises APIError.
        ([], None) when the job reaches the model (`job.cached_tokens` is then set).

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
                if "started" in event:
                    job.cached_tokens = event["cached_tokens"]
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
                pieces = text.feed(event["text"], event.get("tokens", ()))
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


def usage(event: dict, text: TextStream | None = None) -> dict:
    """OpenAI's usage; with the response's `text`, the reasoning tokens it counted."""
    stats = event["stats"]
    completion = stats.get("generated_tokens", 0)
    return {"prompt_tokens": event["prompt_tokens"], "completion_tokens": completion,
            "total_tokens": event["prompt_tokens"] + completion,
            "prompt_tokens_details": {"cached_tokens": event["cached_tokens"]},
            "completion_tokens_details": {
                "reasoning_tokens": text.reasoning_tokens if text is not None else 0},
            "dflash2": {"max_tokens": event.get("max_tokens"),
                        **{k: stats.get(k) for k in USAGE_STATS if k in stats}}}


def openai_tool_calls(calls: list[dict], start: int, streaming: bool) -> list[dict]:
    out = []
    for i, c in enumerate(calls):
        args = c.get("arguments", {})
        out.append({**({"index": start + i} if streaming else {}),
                    "id": c.get("id") or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                    "function": {"name": c["name"], "arguments": args if isinstance(args, str)
                                 else json.dumps(args, ensure_ascii=False)}})
    return out

