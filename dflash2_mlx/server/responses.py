"""`POST /v1/responses`: the OpenAI Responses API, over the same `Service` as chat completions.

A request's `instructions` and `input` items become the chat messages `/v1/chat/completions`
would get for the same conversation, so the prompt ids, and with them the greedy text, are the
same; the pieces `TextStream` cuts out become output items (`reasoning` with
`reasoning_text`, `message` with `output_text`, `function_call`), streamed as the API's typed
events. Stateless: nothing is stored, so `previous_response_id`, `store: true` and stored
items are refused, as is every field this server does not know. Built-in tools it cannot run (web search, ...) are left out of the prompt
and named in the `x-dflash2-ignored-tools` header; namespace tools are flattened into function
tools and their calls answered with the `namespace` field, as Codex routes them; custom
(freeform) tools become functions of one string, `input`. docs/server.md lists every field.
"""

from __future__ import annotations

import base64
import itertools
import json
import time
import uuid
from typing import Annotated, Any, AsyncIterator, Literal, Optional, Union

from fastapi import APIRouter, Body, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

from ..model.sampling import Sampling
from .errors import APIError, validation_error
from .http import PING, Authorized, JSONRoute, ServiceDep, event_stream, sse
from .scheduler import GenerationRequest, Job
from .schemas import MaxTokens, Seed, Temperature, TopK, TopP, content_text
from .service import Service, finish_reason, openai_tool_calls, usage
from .text_stream import Piece, TextStream
from .thinking import effort_switch

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
    namespace: Optional[str] = None                    # a namespace tool's function
    id: Optional[str] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None


class CustomCallItem(_Closed):
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str
    namespace: Optional[str] = None
    id: Optional[str] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None


class FunctionCallOutputItem(_Closed):
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str
    output: Union[str, list[TextPart]]
    name: Optional[str] = None
    namespace: Optional[str] = None
    id: Optional[str] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None


class ReasoningItem(BaseModel):
    """A reasoning item sent back: its text reaches the template as the next assistant turn's
    `reasoning_content` (`reasoning_text`, else this server's `encrypted_content`, else the
    summary); one with none of them (another server's encrypted reasoning) is left out."""
    model_config = ConfigDict(extra="allow")
    type: Literal["reasoning"]
    content: Optional[list[dict]] = None
    summary: Optional[list[dict]] = None
    encrypted_content: Optional[str] = None

    def text(self) -> str:
        for parts in (self.content, self.summary):
            got = "".join(p.get("text") or "" for p in parts or [] if isinstance(p, dict))
            if got:
                return got
        return unseal(self.encrypted_content) or ""


SEAL = "dflash2:"      # this server's `encrypted_content`: the reasoning, in base64


def seal(text: str) -> str:
    return SEAL + base64.b64encode(text.encode()).decode()


def unseal(content: str | None) -> str | None:
    """The reasoning in an `encrypted_content` this server made; None for any other."""
    if not content or not content.startswith(SEAL):
        return None
    try:
        return base64.b64decode(content[len(SEAL):], validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        return None


ITEM_TYPES = ("message", "function_call", "function_call_output", "custom_tool_call",
              "custom_tool_call_output", "reasoning")


def _item_tag(item: Any) -> str:
    # Capitalised tags: `errors._field_path` leaves them out of the field names it reports
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "")
    return "".join(w.title() for w in str(kind).split("_"))


InputItem = Annotated[Union[Annotated[MessageItem, Tag("Message")],
                            Annotated[FunctionCallItem, Tag("FunctionCall")],
                            Annotated[CustomCallItem, Tag("CustomToolCall")],
                            Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")],
                            Annotated[FunctionCallOutputItem, Tag("CustomToolCallOutput")],
                            Annotated[ReasoningItem, Tag("Reasoning")]],
                      Discriminator(_item_tag)]


class FunctionTool(_Closed):
    type: Literal["function"]
    name: str
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class NamespaceTool(_Closed):
    """Function tools under one name (Codex's multi-agent and MCP tools)."""
    type: Literal["namespace"]
    name: str
    description: Optional[str] = None
    tools: list[FunctionTool]


class CustomTool(_Closed):
    """A freeform tool (its input is text, e.g. a patch): offered as a function of `input`."""
    type: Literal["custom"]
    name: str
    description: Optional[str] = None
    format: Optional[dict] = None


Tool = Annotated[Union[Annotated[FunctionTool, Tag("Function")],
                       Annotated[NamespaceTool, Tag("Namespace")],
                       Annotated[CustomTool, Tag("Custom")]], Discriminator(_item_tag)]
TOOL_TYPES = ("function", "namespace", "custom")


class FunctionChoice(_Closed):
    type: Literal["function"]
    name: str


class TextFormat(_Closed):
    type: Literal["text"]


class TextConfig(_Closed):
    format: Optional[TextFormat] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None     # the model decides


class StreamOptions(_Closed):
    include_obfuscation: Optional[bool] = None         # no obfuscation field is ever sent
    reasoning_summary_delivery: Optional[str] = None   # the reasoning comes whole, no summary


class Reasoning(_Closed):
    """The reasoning settings: an effort of "none" or "minimal" turns thinking off, any other
    on; summaries are not made (the reasoning comes whole, as reasoning_text)."""
    effort: Optional[str] = None                       # "low" ... "xhigh", "max": all on
    summary: Optional[Literal["auto", "concise", "detailed", "none"]] = None
    generate_summary: Optional[str] = None


class ResponsesRequest(_Closed):
    model: str
    input: Union[str, Annotated[list[InputItem], Field(min_length=1)]]
    instructions: Optional[str] = None
    tools: Optional[list[Tool]] = None
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
    # the reasoning, sealed, for a client that sends reasoning items back without their text
    include: Optional[list[Literal["reasoning.encrypted_content"]]] = None
    truncation: Optional[Literal["disabled"]] = None   # an overlong prompt is a 400
    text: Optional[TextConfig] = None
    top_logprobs: Optional[Literal[0]] = None
    max_tool_calls: Optional[int] = None               # counts built-in tool calls: none here
    service_tier: Optional[str] = None                 # one tier here
    reasoning: Optional[Reasoning] = None              # effort "none" / "minimal": thinking off
    access_programs: Optional[dict] = None
    # OpenAI's hosted features: refused unless null
    previous_response_id: Optional[Any] = None
    conversation: Optional[Any] = None
    prompt: Optional[Any] = None
    context_management: Optional[Any] = None
    moderation: Optional[Any] = None
    image: Optional[Any] = None
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
    "context_management": "server-side compaction is not served",
    "moderation": "moderation is not served",
    "image": "images are not served",
    "background_options": "background responses are not served",
    "prompt_cache_options": "the prefix cache needs no options: it reuses the longest cached "
                            "prefix of every prompt",
    "prompt_cache_retention": "the prefix cache keeps entries in memory, LRU; see "
                              "--prompt-cache-size",
}
HINTS = {"stop": "the Responses API has no stop strings",
         "max_tokens": "use max_output_tokens", "max_completion_tokens": "use max_output_tokens",
         "messages": "use input (and instructions)"}


def hosted_tools(body: dict) -> list[str]:
    """Takes the built-in tools (web_search, file_search, ...) out of `body`, which this
    server cannot run; their types, for the client to be told."""
    tools = body.get("tools")
    if not isinstance(tools, list):
        return []
    hosted = [t for t in tools if isinstance(t, dict) and isinstance(t.get("type"), str)
              and t["type"] not in TOOL_TYPES]
    body["tools"] = [t for t in tools if not any(t is h for h in hosted)]
    return [t["type"] for t in hosted]


def parse_request(body: dict) -> ResponsesRequest:
    """The body checked field by field (built-in tools already taken out by `hosted_tools`);
    APIError 400 naming the first field refused."""
    for name in body:
        if name not in ResponsesRequest.model_fields:
            why = HINTS.get(name, "this server refuses fields it does not serve rather than "
                                  "ignore them (see docs/server.md)")
            raise APIError(400, f"{name}: unknown field of /v1/responses; {why}", param=name)
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

CUSTOM_INPUT = {"type": "object", "properties": {"input": {
    "type": "string", "description": "The tool's input, as free text"}}, "required": ["input"]}


def flat_name(namespace: str | None, name: str) -> str:
    """The name a namespace's function has in the prompt: `mcp__git__` + `log` is
    `mcp__git__log`, `multi_agent` + `spawn` is `multi_agent__spawn`."""
    if not namespace:
        return name
    return namespace + name if namespace.endswith("_") else f"{namespace}__{name}"


class ToolNames:
    """The tools as the chat template takes them (chat completions' shape, namespaces
    flattened, custom tools as functions of `input`), and the way back from a name the model
    called to the item that reports the call."""

    def __init__(self, tools: list):
        self.functions: list[dict] = []
        self.origin: dict[str, tuple[str | None, str, str]] = {}   # flat -> (ns, name, kind)
        for t in tools:
            inner = t.tools if t.type == "namespace" else [t]
            ns = t.name if t.type == "namespace" else None
            for f in inner:
                flat = flat_name(ns, f.name)
                params = CUSTOM_INPUT if f.type == "custom" else f.parameters
                fn = {"name": flat, "description": f.description, "parameters": params}
                self.functions.append({"type": "function", "function": {
                    k: v for k, v in fn.items() if v is not None}})
                self.origin[flat] = (ns, f.name, f.type)

    def names(self) -> set[str]:
        return set(self.origin)


def chat_tools(req: ResponsesRequest) -> tuple[list[dict] | None, ToolNames]:
    """The tools offered in the prompt; a function named by `tool_choice` is the only one
    offered. The server cannot force a call: "required" and a named function leave the choice
    to the model, as on chat completions."""
    choice = req.tool_choice
    if choice == "required" or isinstance(choice, FunctionChoice):
        if not req.tools:
            raise APIError(400, "tool_choice asks for a tool call, but there are no tools",
                           param="tool_choice")
    names = ToolNames(req.tools or [])
    if not req.tools or choice == "none":
        return None, names
    tools = names.functions
    if isinstance(choice, FunctionChoice):
        tools = [t for t in tools if t["function"]["name"] == choice.name]
        if not tools:
            raise APIError(400, f"tool_choice.name: no function tool named '{choice.name}' in "
                           "tools", param="tool_choice.name")
    return tools, names


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
    tool turn, a reasoning item's text is the next assistant turn's `reasoning_content`."""
    out: list[dict[str, Any]] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    items = ([MessageItem(role="user", content=req.input)] if isinstance(req.input, str)
             else req.input)
    reasoning: list[str] = []           # reasoning items waiting for their assistant turn

    def think(turn: dict) -> None:
        if reasoning:
            turn["reasoning_content"] = "\n\n".join(
                ([turn["reasoning_content"]] if turn.get("reasoning_content") else [])
                + reasoning)
            reasoning.clear()

    for i, item in enumerate(items):
        if item.type == "reasoning":
            if text := item.text():
                reasoning.append(text)
            continue
        if item.type == "message":
            out.append({"role": "system" if item.role == "developer" else item.role,
                        "content": content_text(item.content)})
            if item.role == "assistant":
                think(out[-1])
        elif item.type in ("function_call", "custom_tool_call"):
            args = (_arguments(item.arguments, f"input.{i}.arguments")
                    if item.type == "function_call" else {"input": item.input})
            call = {"id": item.call_id, "type": "function", "function": {
                "name": flat_name(item.namespace, item.name), "arguments": args}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            think(out[-1])
        else:
            out.append({"role": "tool", "content": content_text(item.output),
                        "tool_call_id": item.call_id})
    return out


# --------------------------------------------------------------------------- output items

def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


# (item type, id prefix, the field the call's input is in, its stream events' prefix): a
# function call, and a custom tool's call (its input is text)
CALL_ITEMS = (("function_call", "fc", "arguments", "response.function_call_arguments"),
              ("custom_tool_call", "ctc", "input", "response.custom_tool_call_input"))


class Output:
    """The output items of one response, built from `TextStream` pieces. Every change is also
    returned as the stream events that describe it (without `sequence_number`), so a streamed
    and a plain response hold the same items."""

    def __init__(self, names: ToolNames | None = None, sealed: bool = False):
        self.names = names or ToolNames([])
        self.sealed = sealed                       # reasoning items get `encrypted_content`
        self.items: list[dict] = []
        self._message: dict | None = None          # the message or reasoning item being written
        self._parts: list[str] = []

    def feed(self, pieces: list[Piece]) -> list[dict]:
        events: list[dict] = []
        for p in pieces:
            if p.kind in ("text", "reasoning"):
                kind = "message" if p.kind == "text" else "reasoning"
                if self._message is not None and self._message["type"] != kind:
                    events += self._close_message("completed")
                events += self._open_message(kind)
                self._parts.append(p.text)
                delta = ("response.output_text.delta" if kind == "message"
                         else "response.reasoning_text.delta")
                events.append({"type": delta, **self._where(), "delta": p.text,
                               **({"logprobs": []} if kind == "message" else {})})
                continue
            events += self._close_message("completed")
            for call in openai_tool_calls(p.calls, 0, False):
                name, args = call["function"]["name"], call["function"]["arguments"]
                ns, name, kind = self.names.origin.get(name, (None, name, "function"))
                kind, prefix, field, event = CALL_ITEMS[kind == "custom"]
                value = _custom_input(args) if kind == "custom_tool_call" else args
                item = {"id": _id(prefix), "type": kind, "status": "in_progress",
                        "call_id": call["id"], "name": name,
                        **({"namespace": ns} if ns else {}), field: ""}
                where = {"output_index": len(self.items), "item_id": item["id"]}
                events.append({"type": "response.output_item.added",
                               "output_index": len(self.items), "item": dict(item)})
                events.append({"type": f"{event}.delta", **where, "delta": value})
                events.append({"type": f"{event}.done", **where, field: value})
                item.update({field: value, "status": "completed"})
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

    def _open_message(self, kind: str = "message") -> list[dict]:
        """A message item (its text as one output_text part) or a reasoning item (its text as
        one reasoning_text part, no summary)."""
        if self._message is not None:
            return []
        self._message = ({"id": _id("msg"), "type": "message", "status": "in_progress",
                          "role": "assistant", "content": []} if kind == "message" else
                         {"id": _id("rs"), "type": "reasoning", "status": "in_progress",
                          "summary": [], "content": []})
        self._parts = []
        return [{"type": "response.output_item.added", "output_index": len(self.items),
                 "item": dict(self._message)},
                {"type": "response.content_part.added", **self._where(),
                 "part": _part(kind, "")}]

    def _close_message(self, status: str) -> list[dict]:
        if self._message is None:
            return []
        text, where, kind = "".join(self._parts), self._where(), self._message["type"]
        item = {**self._message, "status": status, "content": [_part(kind, text)]}
        if kind == "reasoning" and self.sealed:
            item["encrypted_content"] = seal(text)
        self.items.append(item)
        self._message = None
        done = ({"type": "response.output_text.done", **where, "text": text, "logprobs": []}
                if kind == "message" else
                {"type": "response.reasoning_text.done", **where, "text": text})
        return [done, {"type": "response.content_part.done", **where, "part": _part(kind, text)},
                {"type": "response.output_item.done", "output_index": where["output_index"],
                 "item": item}]


def _custom_input(arguments: str) -> str:
    """A custom tool's text from the function call the model made (`{"input": ...}`)."""
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    if isinstance(args, dict) and isinstance(args.get("input"), str):
        return args["input"]
    return arguments


def _part(kind: str, text: str) -> dict:
    """A message's output_text part, or a reasoning item's reasoning_text part."""
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _status(final: dict, text: TextStream) -> str:
    return "incomplete" if finish_reason(final, text) == "length" else "completed"


def response_usage(final: dict, text: TextStream | None = None) -> dict:
    """The Responses API's usage (the reasoning tokens `text` counted), plus the `dflash2`
    figures every route reports."""
    u = usage(final, text)
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {
                "reasoning_tokens": u["completion_tokens_details"]["reasoning_tokens"]},
            "total_tokens": u["total_tokens"], "dflash2": u["dflash2"]}


def _head(req: ResponsesRequest, model_id: str) -> dict:
    """The fields of the Response object that echo the request."""
    return {"id": _id("resp"), "object": "response", "created_at": int(time.time()),
            "model": model_id, "instructions": req.instructions,
            "metadata": req.metadata or {}, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": True if req.parallel_tool_calls is None
            else req.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": req.reasoning.model_dump() if req.reasoning is not None else None,
            "store": False,
            "background": False, "service_tier": "default", "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "tool_choice": (req.tool_choice.model_dump() if isinstance(req.tool_choice,
                                                                       FunctionChoice)
                            else req.tool_choice or "auto"),
            "tools": [t.model_dump() for t in req.tools or []]}


def _response(head: dict, status: str, output: list[dict], final: dict | None = None,
              error: dict | None = None, text: TextStream | None = None) -> dict:
    done = status in ("completed", "incomplete", "failed")
    return {**head, "status": status, "output": output, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
            else None,
            "completed_at": int(time.time()) if done else None,
            "usage": response_usage(final, text) if final is not None else None}


# --------------------------------------------------------------------------- the route

@router.post("/v1/responses")
async def create_response(body: Annotated[dict[str, Any], Body()], request: Request,
                          service: ServiceDep):
    """The body comes as a JSON object: `parse_request` checks it (so that it can name the
    field with a hint)."""
    hosted = hosted_tools(body)
    req = parse_request(body)
    service.check_model(req.model)
    sampling = Sampling(1.0 if req.temperature is None else req.temperature,
                        1.0 if req.top_p is None else req.top_p, req.top_k)
    tools, names = chat_tools(req)
    effort = req.reasoning.effort if req.reasoning is not None else None
    prompt = service.render_chat(chat_messages(req), tools, param="input",
                                 thinking=effort_switch(effort))
    head = _head(req, service.config.model_id)
    try:
        limit = service.max_tokens(req.max_output_tokens, len(prompt), "max_output_tokens",
                                   prompt_param="input")
    except APIError as e:
        if not req.stream or e.code != "context_length_exceeded":
            raise
        # a stream reports it as Codex reads it: response.failed with the error's code
        return event_stream(_failed(head, e))
    job = service.submit(GenerationRequest(prompt, limit, sampling, req.seed,
                                           service.checkpoint(prompt)))
    text = service.tool_stream([], tools, prompt)
    headers = service.headers(limit, hosted)
    sealed = "reasoning.encrypted_content" in (req.include or [])
    if req.stream:
        return event_stream(_events(service, job, text, head, Output(names, sealed)), headers)
    out, final = Output(names, sealed), None
    async for pieces, final in service.run(job, text, request):
        out.feed(pieces)
    if final is None:
        return JSONResponse({}, 499)      # the client left; nobody reads this
    status = _status(final, text)
    out.finish(status)
    return JSONResponse(_response(head, status, out.items, final, text=text), headers=headers)


async def _failed(head: dict, e: APIError) -> AsyncIterator[str]:
    """A stream that fails before it starts: response.created, then response.failed."""
    yield sse({"type": "response.created", "sequence_number": 0,
               "response": _response(head, "in_progress", [])}, "response.created")
    yield sse({"type": "response.failed", "sequence_number": 1, "response": _response(
        head, "failed", [], error={"code": e.code, "message": e.message})}, "response.failed")


async def _events(service: Service, job: Job, text: TextStream, head: dict,
                  out: Output) -> AsyncIterator[str]:
    """The typed event stream: response.created, response.in_progress, the events of each
    output item, then response.completed (or .incomplete; an error: error, response.failed)."""
    numbers = itertools.count()

    def typed(event: dict) -> str:
        return sse({**event, "sequence_number": next(numbers)}, event["type"])

    yield typed({"type": "response.created", "response": _response(head, "in_progress", [])})
    yield typed({"type": "response.in_progress",
                 "response": _response(head, "in_progress", [])})
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
                             "response": _response(head, status, out.items, final,
                                                   text=text)})
    except APIError as e:
        yield typed({"type": "error", "code": e.code or e.kind, "message": e.message,
                     "param": e.param})
        yield typed({"type": "response.failed", "response": _response(
            head, "failed", out.items, error={"code": "server_error", "message": e.message})})
