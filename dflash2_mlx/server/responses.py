"""`POST /v1/responses`: the OpenAI Responses API, over the same `Service` as chat completions.

A request's `instructions` and `input` items become the chat messages `/v1/chat/completions`
would get for the same conversation, so the prompt ids, and with them the greedy text, are the
same; the pieces `TextStream` cuts out become output items (`message` with `output_text`,
`function_call`), streamed as the API's typed events. Stateless: nothing is stored, so
`previous_response_id`, `store: true` and stored items are refused, as are built-in tools and
every field this server does not serve (never silently ignored). docs/server.md lists them.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from typing import Annotated, Any, AsyncIterator, Literal, Optional, Union

from fastapi import APIRouter, Body, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

from ..sampling import Sampling
from .errors import APIError, validation_error
from .http import PING, Authorized, JSONRoute, ServiceDep, event_stream, sse
from .scheduler import GenerationRequest, Job
from .schemas import MaxTokens, Seed, Temperature, TopK, TopP, content_text
from .service import Service, finish_reason, openai_tool_calls, usage
from .text_stream import Piece, TextStream

router = APIRouter(route_class=JSONRoute, dependencies=[Authorized])

# --------------------------------------------------------------------------- request schema
# Strict and closed: a field this server does not know is a 400 naming it. The optional fields
# of the items are those the openai client sends back when a response's `output` is appended to
# the next request's `input`.


class _Closed(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class TextPart(_Closed):
    """input_text (user, system, developer turns) or output_text (assistant turns, echoed)."""
    type: Literal["input_text", "output_text"]
    text: str
    annotations: Optional[list] = None
    logprobs: Optional[list] = None
    prompt_cache_breakpoint: Optional[dict] = None     # a hint; the prefix cache finds prefixes


class MessageItem(_Closed):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[TextPart]]
    id: Optional[str] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None
    phase: Optional[Literal["commentary", "final_answer"]] = None


class FunctionCallItem(_Closed):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str                                     # JSON text
    id: Optional[str] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None


class FunctionCallOutputItem(_Closed):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[TextPart]]
    id: Optional[str] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None


ITEM_TYPES = ("message", "function_call", "function_call_output")


def _item_tag(item: Any) -> str:
    # Capitalised tags: `errors._field_path` leaves them out of the field names it reports
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "")
    return "".join(w.title() for w in str(kind).split("_"))


InputItem = Annotated[Union[Annotated[MessageItem, Tag("Message")],
                            Annotated[FunctionCallItem, Tag("FunctionCall")],
                            Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")]],
                      Discriminator(_item_tag)]


class FunctionTool(_Closed):
    type: Literal["function"]
    name: str
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class FunctionChoice(_Closed):
    type: Literal["function"]
    name: str


class TextFormat(_Closed):
    type: Literal["text"]


class TextConfig(_Closed):
    format: Optional[TextFormat] = None
    verbosity: None = None


class StreamOptions(_Closed):
    include_obfuscation: Optional[bool] = None         # no obfuscation field is ever sent


class ResponsesRequest(_Closed):
    model: str
    input: Union[str, Annotated[list[InputItem], Field(min_length=1)]]
    instructions: Optional[str] = None
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], FunctionChoice, None] = None
    max_output_tokens: Optional[MaxTokens] = None
    temperature: Optional[Temperature] = None
    top_p: Optional[TopP] = None
    top_k: TopK = 0                                    # extensions, as on chat completions
    seed: Optional[Seed] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    # accepted because they ask for nothing this server does differently
    store: Optional[bool] = None                       # false: true is refused below
    background: Optional[bool] = None                  # false: true is refused below
    metadata: Optional[dict[str, str]] = None          # echoed back
    client_metadata: Optional[dict[str, str]] = None   # Codex sends it; not echoed
    parallel_tool_calls: Optional[bool] = None         # echoed; the model decides
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    include: Optional[list[Literal["reasoning.encrypted_content"]]] = None   # none is made
    truncation: Optional[Literal["disabled"]] = None   # an overlong prompt is a 400
    text: Optional[TextConfig] = None
    top_logprobs: Optional[Literal[0]] = None
    max_tool_calls: Optional[int] = None               # counts built-in tool calls: none here
    service_tier: Optional[Literal["auto", "default"]] = None
    # OpenAI's hosted features: refused unless null
    previous_response_id: Optional[Any] = None
    conversation: Optional[Any] = None
    prompt: Optional[Any] = None
    reasoning: Optional[Any] = None
    context_management: Optional[Any] = None
    moderation: Optional[Any] = None
    image: Optional[Any] = None
    access_programs: Optional[Any] = None
    background_options: Optional[Any] = None
    prompt_cache_options: Optional[Any] = None
    prompt_cache_retention: Optional[Any] = None


NOT_STORED = ("this server stores no responses or conversations; send the whole conversation "
              "in `input` (and `store: false`)")
REFUSED = {
    "previous_response_id": NOT_STORED,
    "conversation": NOT_STORED,
    "prompt": "stored prompt templates are not served; send the prompt in `instructions` and "
              "`input`",
    "reasoning": "this server has no reasoning settings (the model's chat template decides)",
    "context_management": "server-side compaction is not served",
    "moderation": "moderation is not served",
    "image": "images are not served",
    "access_programs": "access programs are not served",
    "background_options": "background responses are not served",
    "prompt_cache_options": "the prefix cache needs no options: it reuses the longest cached "
                            "prefix of every prompt",
    "prompt_cache_retention": "the prefix cache keeps entries in memory, LRU; see "
                              "--prompt-cache-size",
}
HINTS = {"stop": "the Responses API has no stop strings",
         "max_tokens": "use max_output_tokens", "max_completion_tokens": "use max_output_tokens",
         "messages": "use input (and instructions)"}


def parse_request(body: dict) -> ResponsesRequest:
    """The body checked field by field; APIError 400 naming the first field refused."""
    for name in body:
        if name not in ResponsesRequest.model_fields:
            why = HINTS.get(name, "this server refuses fields it does not serve rather than "
                                  "ignore them (see docs/server.md)")
            raise APIError(400, f"{name}: unknown field of /v1/responses; {why}", param=name)
    tools = body.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise APIError(400, f"tools.{i}.type: '{kind}' is a built-in tool of OpenAI's hosted "
                           "API; this server serves function tools only", param=f"tools.{i}.type")
    items = body.get("input")
    for i, item in enumerate(items if isinstance(items, list) else []):
        if not isinstance(item, dict):
            raise APIError(400, f"input.{i}: an input item is a JSON object", param=f"input.{i}")
        kind = item.get("type", "message")
        if kind not in ITEM_TYPES:
            why = ("an item reference needs stored responses; send the item itself"
                   if kind == "item_reference" else
                   f"this server takes {', '.join(ITEM_TYPES)} items")
            raise APIError(400, f"input.{i}.type: {json.dumps(kind)} items are not served; {why}",
                           param=f"input.{i}.type")
    try:
        req = ResponsesRequest.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None
    for name, why in REFUSED.items():
        if getattr(req, name) is not None:
            raise APIError(400, f"{name}: {why}", param=name)
    if req.store:
        raise APIError(400, f"store: true asks the server to keep the response; {NOT_STORED}",
                       param="store")
    if req.background:
        raise APIError(400, "background: background responses are not served",
                       param="background")
    return req


# --------------------------------------------------------------------------- request -> chat

def chat_tools(req: ResponsesRequest) -> list[dict] | None:
    """The tools, as the chat template takes them (the chat completions shape); a function named
    by `tool_choice` is the only one offered. The server cannot force a call: "required" and a
    named function leave the choice to the model, as on chat completions."""
    choice = req.tool_choice
    if choice == "required" or isinstance(choice, FunctionChoice):
        if not req.tools:
            raise APIError(400, "tool_choice asks for a tool call, but there are no tools",
                           param="tool_choice")
    if not req.tools or choice == "none":
        return None
    tools = req.tools
    if isinstance(choice, FunctionChoice):
        tools = [t for t in tools if t.name == choice.name]
        if not tools:
            raise APIError(400, f"tool_choice.name: no function tool named '{choice.name}' in "
                           "tools", param="tool_choice.name")
    return [{"type": "function", "function": t.model_dump(include={"name", "description",
                                                                    "parameters"},
                                                           exclude_none=True)}
            for t in tools]


def _arguments(text: str, where: str) -> dict:
    try:
        args = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        raise APIError(400, f"{where} is not valid JSON", param=where) from None
    if not isinstance(args, dict):
        raise APIError(400, f"{where} is not a JSON object", param=where)
    return args


def chat_messages(req: ResponsesRequest) -> list[dict]:
    """`instructions` and `input` as chat messages (the shape `openai_routes.openai_messages`
    gives): a function_call joins the assistant turn before it, a function_call_output is a
    tool turn."""
    out: list[dict[str, Any]] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    items = ([MessageItem(role="user", content=req.input)] if isinstance(req.input, str)
             else req.input)
    for i, item in enumerate(items):
        if item.type == "message":
            out.append({"role": "system" if item.role == "developer" else item.role,
                        "content": content_text(item.content)})
        elif item.type == "function_call":
            call = {"id": item.call_id, "type": "function", "function": {
                "name": item.name, "arguments": _arguments(item.arguments, f"input.{i}.arguments")}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            out.append({"role": "tool", "content": content_text(item.output),
                        "tool_call_id": item.call_id})
    return out


# --------------------------------------------------------------------------- output items

def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class Output:
    """The output items of one response, built from `TextStream` pieces. Every change is also
    returned as the stream events that describe it (without `sequence_number`), so a streamed
    and a plain response hold the same items."""

    def __init__(self):
        self.items: list[dict] = []
        self._message: dict | None = None          # the message item being written
        self._parts: list[str] = []

    def feed(self, pieces: list[Piece]) -> list[dict]:
        events: list[dict] = []
        for p in pieces:
            if p.kind == "text":
                events += self._open_message()
                self._parts.append(p.text)
                events.append({"type": "response.output_text.delta", **self._where(),
                               "delta": p.text, "logprobs": []})
                continue
            events += self._close_message("completed")
            for call in openai_tool_calls(p.calls, 0, False):
                item = {"id": _id("fc"), "type": "function_call", "status": "in_progress",
                        "call_id": call["id"], "name": call["function"]["name"],
                        "arguments": ""}
                args = call["function"]["arguments"]
                where = {"item_id": item["id"], "output_index": len(self.items)}
                events.append({"type": "response.output_item.added", "output_index":
                               len(self.items), "item": dict(item)})
                events.append({"type": "response.function_call_arguments.delta", **where,
                               "delta": args})
                events.append({"type": "response.function_call_arguments.done", **where,
                               "arguments": args})
                item.update(arguments=args, status="completed")
                events.append({"type": "response.output_item.done", "output_index":
                               len(self.items), "item": item})
                self.items.append(item)
        return events

    def finish(self, status: str) -> list[dict]:
        """Close the last item; a response with no output at all gets one empty message."""
        events = [] if self.items or self._message else self._open_message()
        return events + self._close_message("incomplete" if status == "incomplete"
                                            else "completed")

    def _where(self) -> dict:
        return {"item_id": self._message["id"], "output_index": len(self.items),
                "content_index": 0}

    def _open_message(self) -> list[dict]:
        if self._message is not None:
            return []
        self._message = {"id": _id("msg"), "type": "message", "status": "in_progress",
                         "role": "assistant", "content": []}
        self._parts = []
        return [{"type": "response.output_item.added", "output_index": len(self.items),
                 "item": {**self._message, "content": []}},
                {"type": "response.content_part.added", **self._where(),
                 "part": _outputcontent_text("")}]

    def _close_message(self, status: str) -> list[dict]:
        if self._message is None:
            return []
        text, where = "".join(self._parts), self._where()
        item = {**self._message, "status": status, "content": [_outputcontent_text(text)]}
        self.items.append(item)
        self._message = None
        return [{"type": "response.output_text.done", **where, "text": text, "logprobs": []},
                {"type": "response.content_part.done", **where, "part": _outputcontent_text(text)},
                {"type": "response.output_item.done", "output_index": where["output_index"],
                 "item": item}]


def _outputcontent_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _status(final: dict, text: TextStream) -> str:
    return "incomplete" if finish_reason(final, text) == "length" else "completed"


def response_usage(final: dict) -> dict:
    """The Responses API's usage, plus the `dflash2` figures every route reports."""
    u = usage(final)
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"], "dflash2": u["dflash2"]}


def _head(req: ResponsesRequest, model_id: str) -> dict:
    """The fields of the Response object that echo the request."""
    return {"id": _id("resp"), "object": "response", "created_at": int(time.time()),
            "model": model_id, "instructions": req.instructions,
            "metadata": req.metadata or {}, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": True if req.parallel_tool_calls is None
            else req.parallel_tool_calls,
            "previous_response_id": None, "reasoning": None, "store": False,
            "background": False, "service_tier": "default", "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "tool_choice": (req.tool_choice.model_dump() if isinstance(req.tool_choice,
                                                                       FunctionChoice)
                            else req.tool_choice or "auto"),
            "tools": [t.model_dump() for t in req.tools or []]}


def _response(head: dict, status: str, output: list[dict], final: dict | None = None,
              error: dict | None = None) -> dict:
    done = status in ("completed", "incomplete", "failed")
    return {**head, "status": status, "output": output, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
            else None,
            "completed_at": int(time.time()) if done else None,
            "usage": response_usage(final) if final is not None else None}


# --------------------------------------------------------------------------- the route

@router.post("/v1/responses")
async def create_response(body: Annotated[dict[str, Any], Body()], request: Request,
                          service: ServiceDep):
    """The body comes as a JSON object: `parse_request` checks it (so that it can name the
    field with a hint)."""
    req = parse_request(body)
    service.check_model(req.model)
    sampling = Sampling(1.0 if req.temperature is None else req.temperature,
                        1.0 if req.top_p is None else req.top_p, req.top_k)
    tools = chat_tools(req)
    prompt = service.render_chat(chat_messages(req), tools, param="input")
    limit = service.max_tokens(req.max_output_tokens, len(prompt), "max_output_tokens",
                               prompt_param="input")
    job = service.submit(GenerationRequest(prompt, limit, sampling, req.seed))
    text = service.tool_stream([], tools)
    head = _head(req, service.config.model_id)
    if req.stream:
        return event_stream(_events(service, job, text, head))
    out, final = Output(), None
    async for pieces, final in service.run(job, text, request):
        out.feed(pieces)
    if final is None:
        return JSONResponse({}, 499)      # the client left; nobody reads this
    status = _status(final, text)
    out.finish(status)
    return _response(head, status, out.items, final)


async def _events(service: Service, job: Job, text: TextStream,
                  head: dict) -> AsyncIterator[str]:
    """The typed event stream: response.created, response.in_progress, the events of each
    output item, then response.completed (or .incomplete; an error: error, response.failed)."""
    numbers = itertools.count()

    def typed(event: dict) -> str:
        return sse({**event, "sequence_number": next(numbers)}, event["type"])

    yield typed({"type": "response.created", "response": _response(head, "in_progress", [])})
    yield typed({"type": "response.in_progress",
                 "response": _response(head, "in_progress", [])})
    out = Output()
    try:
        async for pieces, final in service.run(job, text):
            if not pieces and final is None:
                yield PING
            for event in out.feed(pieces):
                yield typed(event)
            if final is not None:
                status = _status(final, text)
                for event in out.finish(status):
                    yield typed(event)
                yield typed({"type": f"response.{status}",
                             "response": _response(head, status, out.items, final)})
    except APIError as e:
        yield typed({"type": "error", "code": e.code or e.kind, "message": e.message,
                     "param": e.param})
        yield typed({"type": "response.failed", "response": _response(
            head, "failed", out.items, error={"code": "server_error", "message": e.message})})
