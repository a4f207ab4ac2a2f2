"""`dflash2-mlx serve`: OpenAI- and Anthropic-compatible HTTP APIs over `Pipeline.stream`.

The HTTP layer only: requests are checked and rendered into prompt ids here, then handed to a
`Scheduler`, which owns the model and runs one generation at a time on its own thread. What the
client sees (stop strings, tool calls) is cut out of the streamed text by `TextStream`.

  OpenAI     GET /v1/models, POST /v1/chat/completions, POST /v1/completions, GET /health,
             POST /v1/responses (the Responses API, in `responses.py`)
  Anthropic  POST /v1/messages

Errors come in the shape of the API that was called (`{"error": {...}}` for OpenAI,
`{"type": "error", "error": {...}}` for Anthropic), with the field named where there is one.
Needs the `serve` extra (FastAPI, uvicorn).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine import DecodeState
from .pipeline import Pipeline
from .prompt_cache import PromptCache
from .sampling import Sampling
from .settings import PROMPT_CACHE_DISK_BYTES, SEED_MAX, SettingError, byte_size

log = logging.getLogger("dflash2_mlx.server")

MAX_STOPS = 16
# the acceptance figures of a request, reported as usage["dflash2"] (GenerationStats.to_dict)
USAGE_STATS = ("block_size", "tau", "cycles", "steps", "plain_steps", "mean_width",
               "cycles_drafter", "tau_drafter", "cycles_lookup", "tau_lookup",
               "cached_tokens", "prefill_s", "decode_s", "decode_tps")


# --------------------------------------------------------------------------- settings, errors

@dataclass(frozen=True)
class ServerConfig:
    """Limits and identity of one server. `model_id` is the only model name a request may use."""

    model_id: str
    max_tokens: int = 4096              # most tokens one request may ask for
    context_length: int = 8192          # prompt + completion tokens
    max_body_bytes: int = 4 * 2**20
    queue_size: int = 16                # requests waiting for the model, besides the running one
    api_key: str | None = None
    block_size: int | str | None = None     # None: the pipeline's default
    prompt_cache_size: int = 8              # entries in RAM; 0: none (and no disk: no cache)
    prompt_cache_bytes: int = 2 * 2**30
    prompt_cache_dir: str | None = None     # the prefix cache's disk tier (None: RAM only)
    prompt_cache_disk_bytes: int = PROMPT_CACHE_DISK_BYTES

    def __post_init__(self):
        object.__setattr__(self, "prompt_cache_disk_bytes",
                           byte_size(self.prompt_cache_disk_bytes, "prompt_cache_disk_bytes"))


class APIError(Exception):
    """An error answered in the called API's own shape. kind: an OpenAI error type; the
    Anthropic type is derived from the status."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = \
            status, message, param, code, kind


ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                         403: "permission_error", 404: "not_found_error",
                         405: "invalid_request_error", 413: "request_too_large",
                         429: "rate_limit_error", 503: "overloaded_error"}


def _is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(err: APIError, anthropic: bool) -> dict:
    if anthropic:
        return {"type": "error", "error": {
            "type": ANTHROPIC_ERROR_TYPES.get(err.status, "api_error"), "message": err.message}}
    return {"error": {"message": err.message, "type": err.kind, "param": err.param,
                      "code": err.code}}


# --------------------------------------------------------------------------- request schemas
# Strict: a string where a number belongs is a 400, not a silent conversion. Unknown fields are
# ignored, as the hosted APIs' clients send fields we do not use.

class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ToolFunction(_Strict):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict] = None


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: ToolFunction


class CalledFunction(_Strict):
    name: str
    arguments: Union[str, dict]


class ToolCall(_Strict):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None


class StreamOptions(_Strict):
    include_usage: bool = False


class _OpenAISampling(_Strict):
    model: str
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, allow_inf_nan=False)
    top_p: float = Field(1.0, allow_inf_nan=False)
    top_k: int = 0                                     # extension, as mlx-lm's server
    seed: Optional[int] = Field(None, ge=0, le=SEED_MAX)
    stop: Union[str, list[str], None] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logprobs: Optional[Union[bool, int]] = None


class ChatRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    tools: Optional[list[Tool]] = None
    tool_choice: Union[str, dict, None] = None


class CompletionRequest(_OpenAISampling):
    prompt: Union[str, list[str], list[int]]
    echo: bool = False


class AnthropicBlock(_Strict):
    """text, tool_use (assistant turns) and tool_result (user turns) content blocks."""
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text", "tool_use", "tool_result"]
    text: Optional[str] = None
    id: Optional[str] = None
    name: Optional[str] = None
    input: Optional[dict] = None
    tool_use_id: Optional[str] = None
    content: Union[str, list[TextPart], None] = None


class AnthropicMessage(_Strict):
    role: Literal["user", "assistant"]
    content: Union[str, list[AnthropicBlock]]


class AnthropicTool(_Strict):
    name: str
    description: Optional[str] = None
    input_schema: dict = Field(default_factory=dict)


class MessagesRequest(_Strict):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: Union[str, list[TextPart], None] = None
    temperature: float = Field(1.0, allow_inf_nan=False)
    top_p: float = Field(1.0, allow_inf_nan=False)
    top_k: int = 0
    stop_sequences: Optional[list[str]] = None
    stream: bool = False
    tools: Optional[list[AnthropicTool]] = None
    tool_choice: Optional[dict] = None
    metadata: Optional[dict] = None


_UNION_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def _field_path(loc: tuple) -> tuple:
    """A pydantic error location without its union-branch tags ('str', 'list[TextPart]')."""
    return tuple(p for p in loc if not (isinstance(p, str) and (
        p in _UNION_TAGS or "[" in p or p[:1].isupper())))


def _validation_error(e: ValidationError) -> APIError:
    """The first bad field, named; where it failed every branch of a union, the deepest
    complaint (an image part in `content`: "...content.0.type: Input should be 'text'")."""
    errors = e.errors()
    field0 = _field_path(errors[0]["loc"])
    same = [x for x in errors if _field_path(x["loc"])[:len(field0)] == field0]
    depth = max(len(_field_path(x["loc"])) for x in same)
    path = next(_field_path(x["loc"]) for x in same if len(_field_path(x["loc"])) == depth)
    deepest = [x for x in same if _field_path(x["loc"]) == path]
    where = ".".join(str(p) for p in path)
    msg = " or ".join(dict.fromkeys(x["msg"] for x in deepest))
    return APIError(400, f"{where}: {msg}" if where else msg, param=where or None)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


# --------------------------------------------------------------------------- generation jobs

@dataclass
class GenerationRequest:
    """What the model runs: prompt ids and sampling; stop strings and tools stay in HTTP."""

    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    seed: int | None = None


@dataclass
class Job:
    """One request's place in the queue and its channel back to the HTTP handler."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    why: str | None = None       # "client" (it left), "stop" (a stop string), "done", "shutdown"

    def cancel(self, why: str = "client") -> None:
        """Stop at the next cycle; the first reason given is kept."""
        if not self.cancelled.is_set():
            self.why = why
            self.cancelled.set()

    def emit(self, event: dict) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:      # the event loop is gone (shutdown): nobody is listening
            pass


class QueueFull(Exception):
    pass


class Scheduler:
    """Requests wait in a bounded first-in first-out queue; one worker thread owns the model and
    runs them one at a time, so MLX never sees two generations at once.

    The HTTP layer only calls `submit` and reads `Job.events` (dicts: {"text", "tokens"} per
    cycle, then {"done": finish_reason, "stats", "prompt_tokens", "cached_tokens"} or
    {"error": message}); a batching scheduler can replace `_run` without touching the routes.
    """

    def __init__(self, pipe: Pipeline, *, queue_size: int = 16,
                 block_size: int | str | None = None, prompt_cache=None):
        self.pipe = pipe
        self.block_size = block_size
        self.prompt_cache = prompt_cache
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self._thread: threading.Thread | None = None
        self._running = False
        self.busy = False
        self._current: Job | None = None
        self.served = 0
        self.cancelled = 0           # generations ended early because the client left

    def start(self) -> None:
        """Run the worker on a thread of its own (an app served by another ASGI runner).
        `serve` runs it on the main thread instead: with MLX 0.32 (CPU) a process whose MLX
        work ran on another thread sometimes aborts at exit (std::terminate)."""
        self._thread = threading.Thread(target=self.work, name="dflash2-generate", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel the running job at its next cycle and end the worker; queued jobs are told
        the server stopped."""
        if (job := self._current) is not None:
            job.cancel("shutdown")
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.emit({"error": "the server is shutting down", "status": 503})
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> Job:
        job = Job(request, loop)
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull from None
        return job

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    @property
    def alive(self) -> bool:
        return self._running

    def work(self) -> None:
        """Run jobs until `stop`; on whichever thread calls it."""
        self._running = True
        try:
            self._serve_jobs()
        finally:
            self._running = False
            if self.prompt_cache is not None:
                self.prompt_cache.close()       # the disk tier writes what is queued

    def _serve_jobs(self) -> None:
        while (job := self._queue.get()) is not None:
            if job.cancelled.is_set():        # its client left while it waited
                self.cancelled += 1
                continue
            self.busy, self._current = True, job
            try:
                self._run(job)
            except Exception as e:  # noqa: BLE001 - reported to that request; the next one runs
                log.exception("generation failed")
                job.emit({"error": f"{type(e).__name__}: {e}", "status": 500})
            finally:
                self.served += 1
                self.cancelled += job.why == "client"
                self.busy, self._current = False, None

    def _run(self, job: Job) -> None:
        r = job.request
        s = r.sampling
        cache = self.prompt_cache
        state = None
        if cache is not None:
            state, _ = cache.fetch(r.prompt)
            if state is None:
                state = DecodeState.new(self.pipe.adapter, self.pipe.drafter)
        chunk = None
        steps = self.pipe.stream(r.prompt, max_tokens=r.max_tokens, temperature=s.temperature,
                                 top_p=s.top_p, top_k=s.top_k, seed=r.seed,
                                 block_size=self.block_size, state=state)
        try:
            for chunk in steps:
                job.emit({"text": chunk.text, "tokens": list(chunk.tokens)})
                if job.cancelled.is_set():
                    break
        finally:
            steps.close()          # a cancelled generation frees the model here
        if cache is not None:
            # the state now covers the prompt and the answer (but its last token): the next
            # turn of this conversation starts from it. An exception above skips this.
            cache.insert(state)
        stats = chunk.stats.to_dict() if chunk is not None else {}
        finish = (chunk.finish_reason if chunk is not None else None) or "cancelled"
        job.emit({"done": finish, "stats": stats, "prompt_tokens": len(r.prompt),
                  "cached_tokens": stats.get("cached_tokens", 0)})


# --------------------------------------------------------------------------- visible text

@dataclass
class Piece:
    kind: Literal["text", "tool"]
    text: str = ""
    calls: list[dict] = field(default_factory=list)    # parsed: [{"name", "arguments"}]


class TextStream:
    """Detokenized deltas in, what the client sees out: text up to (not including) the first
    stop string, found across token boundaries, and tool-call spans (between the template's
    start and end markers) cut out and parsed with mlx-lm's parser for the template.

    Text that could be the beginning of a stop string or a tool-call marker is held back until
    the next delta decides it.
    """

    def __init__(self, stops: list[str] = (), tool_markers: tuple[str, str] | None = None,
                 parse: Callable[[str], Any] | None = None):
        self.stops = [s for s in stops if s]
        self.tool_markers = tool_markers if parse is not None else None
        self.parse = parse
        self.buffer = ""
        self.in_tool = False
        self.stopped: str | None = None        # the stop string that ended the text
        self.made_tool_call = False

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a marker."""
        markers = self.stops + ([self.tool_markers[0]] if self.tool_markers else [])
        best = 0
        for m in markers:
            for n in range(min(len(m) - 1, len(text)), best, -1):
                if text.endswith(m[:n]):
                    best = n
                    break
        return best

    def feed(self, delta: str) -> list[Piece]:
        if self.stopped is not None:
            return []
        self.buffer += delta
        out: list[Piece] = []
        while True:
            if self.in_tool:
                end = self.buffer.find(self.tool_markers[1])
                if end < 0:
                    return out
                out.append(self._tool_piece(self.buffer[:end]))
                self.buffer = self.buffer[end + len(self.tool_markers[1]):]
                self.in_tool = False
                continue
            hits = [(self.buffer.find(s), s) for s in self.stops]
            stop_at, stop = min(((i, s) for i, s in hits if i >= 0), default=(-1, None))
            tool_at = self.buffer.find(self.tool_markers[0]) if self.tool_markers else -1
            if stop_at >= 0 and (tool_at < 0 or stop_at <= tool_at):
                self._text(out, self.buffer[:stop_at])
                self.buffer, self.stopped = "", stop
                return out
            if tool_at >= 0:
                self._text(out, self.buffer[:tool_at])
                self.buffer = self.buffer[tool_at + len(self.tool_markers[0]):]
                self.in_tool = True
                continue
            keep = self._held_back(self.buffer)
            self._text(out, self.buffer[:len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep:]
            return out

    def finish(self) -> list[Piece]:
        """The end of the generation: flush what was held back. An unterminated tool call is
        parsed if it can be (the end marker may have been a stop token), else kept as text."""
        out: list[Piece] = []
        if self.stopped is None and self.in_tool:
            piece = self._tool_piece(self.buffer)
            if piece.calls:
                out.append(piece)
            else:
                self._text(out, self.tool_markers[0] + self.buffer)
        elif self.stopped is None:
            self._text(out, self.buffer)
        self.buffer, self.in_tool = "", False
        return out

    @staticmethod
    def _text(out: list[Piece], text: str) -> None:
        if text:
            out.append(Piece("text", text))

    def _tool_piece(self, text: str) -> Piece:
        try:
            parsed = self.parse(text)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("could not parse a tool call (%s: %s): %r", type(e).__name__, e, text)
            return Piece("text", self.tool_markers[0] + text + self.tool_markers[1])
        calls = parsed if isinstance(parsed, list) else [parsed]
        calls = [c for c in calls if isinstance(c, dict) and "name" in c]
        if not calls:
            return Piece("text", self.tool_markers[0] + text + self.tool_markers[1])
        self.made_tool_call = True
        return Piece("tool", calls=calls)


# --------------------------------------------------------------------------- the service

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

    def sampling(self, temperature: float, top_p: float, top_k: int) -> Sampling:
        """The API's own checks (`settings`, through `Sampling`), answered as a 400."""
        try:
            return Sampling(temperature, top_p, top_k)
        except SettingError as e:
            raise APIError(400, str(e), param=e.name) from None

    def max_tokens(self, asked: int | None, prompt_len: int, param: str = "max_tokens") -> int:
        c = self.config
        if prompt_len >= c.context_length:
            raise APIError(400, f"the prompt has {prompt_len} tokens; this model's context is "
                           f"{c.context_length} tokens", param="messages",
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
    def render_chat(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """Messages (OpenAI shape, content as a string) -> prompt ids, through the model's
        chat template exactly as `Pipeline.encode` renders one user message."""
        tok = self.pipe.tokenizer
        if not self.has_template:
            text = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages)
            return tok.encode(text + "assistant:")
        try:
            text = tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                           add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - a template's own refusal (jinja raise_exception)
            raise APIError(400, f"the chat template refused these messages: {e}",
                           param="messages") from None
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

    async def run(self, job: Job, text: TextStream,
                  request: Request | None = None) -> AsyncIterator[tuple[list[Piece], dict | None]]:
        """(pieces, None) per cycle, then ([], final event). The job is cancelled if the consumer
        stops early (a streaming client left), when a stop string ends the text, or, with
        `request` (non-streaming), when the client disconnects."""
        try:
            while True:
                if request is None:
                    event = await job.events.get()
                else:
                    try:
                        event = await asyncio.wait_for(job.events.get(), 0.5)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            log.info("client disconnected: generation cancelled")
                            return
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


def _finish_reason(event: dict, text: TextStream) -> str:
    if text.stopped is not None:
        return "stop"
    if text.made_tool_call:
        return "tool_calls"
    return "length" if event["done"] == "length" else "stop"


def _usage(event: dict) -> dict:
    stats = event["stats"]
    completion = stats.get("generated_tokens", 0)
    return {"prompt_tokens": event["prompt_tokens"], "completion_tokens": completion,
            "total_tokens": event["prompt_tokens"] + completion,
            "prompt_tokens_details": {"cached_tokens": event["cached_tokens"]},
            "dflash2": {k: stats.get(k) for k in USAGE_STATS if k in stats}}


def _openai_tool_calls(calls: list[dict], start: int, streaming: bool) -> list[dict]:
    out = []
    for i, c in enumerate(calls):
        args = c.get("arguments", {})
        out.append({**({"index": start + i} if streaming else {}),
                    "id": c.get("id") or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                    "function": {"name": c["name"], "arguments": args if isinstance(args, str)
                                 else json.dumps(args, ensure_ascii=False)}})
    return out


def _sse(data: dict | str, event: str | None = None) -> str:
    body = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "") + f"data: {body}\n\n"


# --------------------------------------------------------------------------- request -> messages

def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.text for p in content)


def openai_messages(req: ChatRequest) -> list[dict]:
    out = []
    for i, m in enumerate(req.messages):
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                               "content": _text(m.content)}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
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


def anthropic_messages(req: MessagesRequest) -> list[dict]:
    out: list[dict] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system)})
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
                            "content": _text(b.content)})
        if text or calls:
            msg: dict[str, Any] = {"role": m.role, "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def anthropic_tools(req: MessagesRequest) -> list[dict] | None:
    if not req.tools or (req.tool_choice or {}).get("type") == "none":
        return None
    return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.input_schema}}
            for t in req.tools]


# --------------------------------------------------------------------------- the app

def model_id_for(model: str) -> str:
    """The name clients use: a hub id as given, a local folder or file by its name (a request
    never names a path)."""
    p = Path(model)
    if p.exists():
        return p.stem if p.is_file() else p.name
    return model


def create_app(pipe: Pipeline, config: ServerConfig, *, worker_thread: bool = True) -> FastAPI:
    """The ASGI app (`app.state.scheduler` runs the generations). worker_thread: the scheduler's
    worker starts on its own thread with the app's lifespan; False: the caller runs
    `scheduler.work()` (as `serve` does, on the main thread). It stops with the lifespan."""
    disk = None
    if config.prompt_cache_dir is not None:
        from .disk_cache import DiskCache

        disk = DiskCache(config.prompt_cache_dir, config.prompt_cache_disk_bytes,
                         target=pipe.adapter, drafter=pipe.drafter)
    prompt_cache = (PromptCache(config.prompt_cache_size, config.prompt_cache_bytes, disk)
                    if config.prompt_cache_size > 0 or disk is not None else None)
    scheduler = Scheduler(pipe, queue_size=config.queue_size, block_size=config.block_size,
                          prompt_cache=prompt_cache)
    service = Service(pipe, config, scheduler)

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_app):
        if worker_thread:
            scheduler.start()
        yield
        await asyncio.to_thread(scheduler.stop)

    app = FastAPI(title="dflash2-mlx", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.service, app.state.scheduler = service, scheduler

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return JSONResponse(error_body(err, _is_anthropic(request.url.path)), err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        err = APIError(exc.status_code, str(exc.detail), kind="invalid_request_error")
        return JSONResponse(error_body(err, _is_anthropic(request.url.path)), exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error")
        err = APIError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")
        return JSONResponse(error_body(err, _is_anthropic(request.url.path)), 500)

    def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        given = request.headers.get("x-api-key")
        auth = request.headers.get("authorization", "")
        if given is None and auth[:7].lower() == "bearer ":
            given = auth[7:].strip()
        # constant time: the comparison does not leak how much of the key matched
        if given is None or not hmac.compare_digest(given.encode(), config.api_key.encode()):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer KEY or "
                           "x-api-key: KEY)", kind="authentication_error",
                           code="invalid_api_key")

    async def read(request: Request, schema: type[BaseModel]):
        authorize(request)
        limit = config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"the request body is {declared} bytes; the limit is {limit}")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise APIError(413, f"the request body is over the limit of {limit} bytes")
        try:
            data = json.loads(body, parse_constant=_reject_constant)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object")
        try:
            return schema.model_validate(data)
        except ValidationError as e:
            raise _validation_error(e) from None

    def check_openai(req: _OpenAISampling) -> None:
        service.check_model(req.model)
        if req.n != 1:
            raise APIError(400, f"n = {req.n}: this server returns one choice per request "
                           "(n = 1)", param="n")
        if req.logprobs:
            raise APIError(400, "logprobs are not supported by this server", param="logprobs")

    # ---- OpenAI
    @app.get("/health")
    async def health():
        ok = scheduler.alive
        return JSONResponse({"status": "ok" if ok else "unavailable", "model": config.model_id,
                             "busy": scheduler.busy, "waiting": scheduler.waiting,
                "served": scheduler.served, "cancelled": scheduler.cancelled,
                "prompt_cache": None if prompt_cache is None else {
                    **prompt_cache.stats.to_dict(), "entries": len(prompt_cache),
                    "bytes": prompt_cache.nbytes,
                    "disk": prompt_cache.disk.describe() if prompt_cache.disk else None}},
                            200 if ok else 503)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [_model_card(config.model_id)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request):
        authorize(request)
        service.check_model(name)
        return _model_card(name)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req: ChatRequest = await read(request, ChatRequest)
        check_openai(req)
        sampling = service.sampling(req.temperature, req.top_p, req.top_k)
        stops = service.stops(req.stop)
        tools = openai_tools(req)
        prompt = service.render_chat(openai_messages(req), tools)
        asked, param = ((req.max_completion_tokens, "max_completion_tokens")
                        if req.max_completion_tokens is not None
                        else (req.max_tokens, "max_tokens"))
        limit = service.max_tokens(asked, len(prompt), param)
        job = service.submit(GenerationRequest(prompt, limit, sampling, req.seed))
        text = service.tool_stream(stops, tools)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
                "model": config.model_id}
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return _event_stream(_chat_chunks(service, job, text, head, usage))
        content, calls, final = [], [], None
        async for pieces, final in service.run(job, text, request):
            for p in pieces:
                content.append(p.text) if p.kind == "text" else calls.extend(p.calls)
        if final is None:
            return JSONResponse({}, 499)      # the client left; nobody reads this
        message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
        if calls:
            message["tool_calls"] = _openai_tool_calls(calls, 0, False)
        return {**head, "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": _finish_reason(final, text)}],
                "usage": _usage(final)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req: CompletionRequest = await read(request, CompletionRequest)
        check_openai(req)
        if req.echo:
            raise APIError(400, "echo is not supported by this server", param="echo")
        sampling = service.sampling(req.temperature, req.top_p, req.top_k)
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
            prompt = pipe.encode(p, chat_template=False)
        except ValueError as e:
            raise APIError(400, f"prompt: {e}", param="prompt") from None
        limit = service.max_tokens(req.max_tokens, len(prompt))
        job = service.submit(GenerationRequest(prompt, limit, sampling, req.seed))
        text = TextStream(stops)
        head = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
                "model": config.model_id, "object": "text_completion"}
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return _event_stream(_completion_chunks(service, job, text, head, usage))
        out, final = [], None
        async for pieces, final in service.run(job, text, request):
            out.extend(p.text for p in pieces)
        if final is None:
            return JSONResponse({}, 499)
        return {**head, "choices": [{"index": 0, "text": "".join(out), "logprobs": None,
                                     "finish_reason": _finish_reason(final, text)}],
                "usage": _usage(final)}

    # ---- Anthropic
    @app.post("/v1/messages")
    async def messages(request: Request):
        req: MessagesRequest = await read(request, MessagesRequest)
        service.check_model(req.model)
        sampling = service.sampling(req.temperature, req.top_p, req.top_k)
        stops = service.stops(req.stop_sequences)
        tools = anthropic_tools(req)
        prompt = service.render_chat(anthropic_messages(req), tools)
        limit = service.max_tokens(req.max_tokens, len(prompt))
        job = service.submit(GenerationRequest(prompt, limit, sampling, None))
        text = service.tool_stream(stops, tools)
        head = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
                "model": config.model_id}
        if req.stream:
            return _event_stream(_anthropic_events(service, job, text, head, len(prompt)))
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
            return JSONResponse({}, 499)
        reason, seq = _stop_reason(final, text)
        return {**head, "content": blocks, "stop_reason": reason, "stop_sequence": seq,
                "usage": _anthropic_usage(final)}

    from .responses import add_routes      # here: responses.py imports this module
    add_routes(app, service, read)
    return app


def _model_card(model_id: str) -> dict:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "dflash2-mlx"}


def _event_stream(chunks: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _chat_chunks(service: Service, job: Job, text: TextStream, head: dict,
                       include_usage: bool) -> AsyncIterator[str]:
    base = {**head, "object": "chat.completion.chunk"}
    extra = {"usage": None} if include_usage else {}

    def chunk(delta: dict, finish: str | None = None) -> str:
        return _sse({**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                          "finish_reason": finish}], **extra})

    yield chunk({"role": "assistant", "content": ""})
    calls = 0
    try:
        async for pieces, final in service.run(job, text):
            for p in pieces:
                if p.kind == "text":
                    yield chunk({"content": p.text})
                else:
                    yield chunk({"tool_calls": _openai_tool_calls(p.calls, calls, True)})
                    calls += len(p.calls)
            if final is not None:
                yield chunk({}, _finish_reason(final, text))
                if include_usage:
                    yield _sse({**base, "choices": [], "usage": _usage(final)})
    except APIError as e:
        yield _sse(error_body(e, False))
    yield _sse("[DONE]")


async def _completion_chunks(service: Service, job: Job, text: TextStream, head: dict,
                             include_usage: bool) -> AsyncIterator[str]:
    extra = {"usage": None} if include_usage else {}

    def chunk(t: str, finish: str | None = None) -> str:
        return _sse({**head, "choices": [{"index": 0, "text": t, "logprobs": None,
                                          "finish_reason": finish}], **extra})

    try:
        async for pieces, final in service.run(job, text):
            for p in pieces:
                yield chunk(p.text)
            if final is not None:
                yield chunk("", _finish_reason(final, text))
                if include_usage:
                    yield _sse({**head, "choices": [], "usage": _usage(final)})
    except APIError as e:
        yield _sse(error_body(e, False))
    yield _sse("[DONE]")


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
    usage = _usage(final)
    return {"input_tokens": final["prompt_tokens"] - final["cached_tokens"],
            "output_tokens": usage["completion_tokens"],
            "cache_read_input_tokens": final["cached_tokens"],
            "cache_creation_input_tokens": 0, "dflash2": usage["dflash2"]}


async def _anthropic_events(service: Service, job: Job, text: TextStream, head: dict,
                            prompt_tokens: int) -> AsyncIterator[str]:
    yield _sse({"type": "message_start", "message": {
        **head, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}}, "message_start")
    index, open_text = 0, False
    try:
        async for pieces, final in service.run(job, text):
            for p in pieces:
                if p.kind == "text":
                    if not open_text:
                        yield _sse({"type": "content_block_start", "index": index,
                                    "content_block": {"type": "text", "text": ""}},
                                   "content_block_start")
                        open_text = True
                    yield _sse({"type": "content_block_delta", "index": index,
                                "delta": {"type": "text_delta", "text": p.text}},
                               "content_block_delta")
                    continue
                if open_text:
                    yield _sse({"type": "content_block_stop", "index": index},
                               "content_block_stop")
                    index, open_text = index + 1, False
                for call in p.calls:
                    block = _tool_use(call)
                    yield _sse({"type": "content_block_start", "index": index,
                                "content_block": {**block, "input": {}}}, "content_block_start")
                    yield _sse({"type": "content_block_delta", "index": index,
                                "delta": {"type": "input_json_delta",
                                          "partial_json": json.dumps(block["input"])}},
                               "content_block_delta")
                    yield _sse({"type": "content_block_stop", "index": index},
                               "content_block_stop")
                    index += 1
            if final is not None:
                if open_text:
                    yield _sse({"type": "content_block_stop", "index": index},
                               "content_block_stop")
                reason, seq = _stop_reason(final, text)
                usage = _anthropic_usage(final)
                yield _sse({"type": "message_delta",
                            "delta": {"stop_reason": reason, "stop_sequence": seq},
                            "usage": {"output_tokens": usage["output_tokens"]}},
                           "message_delta")
                yield _sse({"type": "message_stop"}, "message_stop")
    except APIError as e:
        yield _sse(error_body(e, True), "error")


# --------------------------------------------------------------------------- running it

def serve(pipe: Pipeline, config: ServerConfig, *, host: str = "127.0.0.1", port: int = 8080,
          shutdown_timeout: float = 5.0,
          ready: Callable[[str], object] | None = None) -> None:
    """Serve until SIGINT / SIGTERM, then return (exit status 0). In-flight requests get
    `shutdown_timeout` seconds to finish, then are cancelled at their next cycle.

    The generations run on the calling (main) thread, HTTP on a uvicorn thread: MLX stays on
    one thread, and the signals reach the main thread, where Python delivers them."""
    import signal

    import uvicorn

    app = create_app(pipe, config, worker_thread=False)
    scheduler: Scheduler = app.state.scheduler

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started and ready is not None:
                bound = [s.getsockname() for srv in self.servers for s in srv.sockets]
                where = bound[0] if bound else (host, port)
                ready(f"http://{_host_for_url(where[0])}:{where[1]}")

    server = Server(uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False,
        timeout_graceful_shutdown=max(1, int(round(shutdown_timeout))), lifespan="on"))

    def on_signal(sig, _frame):
        if server.should_exit and sig == signal.SIGINT:
            server.force_exit = True            # a second Ctrl-C: stop waiting
        server.should_exit = True

    def http() -> None:
        try:
            server.run()            # off the main thread, uvicorn installs no signal handlers
        finally:
            scheduler.stop()        # also when it could not start (e.g. the port is taken)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=http, name="dflash2-http")
    thread.start()
    try:
        scheduler.work()
    finally:
        server.should_exit = True
        thread.join()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        raise OSError(f"could not listen on {host}:{port} (see the message above)")


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host
