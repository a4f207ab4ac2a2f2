"""The Responses API's input: the request's schema (strict and closed), its checks and refusals,
and its conversion to the chat messages and tools `/v1/chat/completions` would get for the same
conversation (so the prompt ids, and with them the greedy text, are the same). Reasoning items
come back sealed in this server's `encrypted_content` (`seal`, `unseal`)."""

from __future__ import annotations

import base64
import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

from .errors import APIError, validation_error
from .images import parts_of
from .schemas import MaxTokens, Seed, Temperature, TopK, TopP

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


class ImagePart(_Closed):
    """input_image: a data: URL (base64) or an http(s) URL in image_url (file_id: refused,
    no files are stored here)."""
    type: Literal["input_image"]
    image_url: Optional[str] = None
    file_id: Optional[str] = None
    detail: Optional[str] = None


Part = Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]


class MessageItem(_Closed):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[Part]]
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
    output: Union[str, list[Part]]
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
                        "content": parts_of(item.content, f"input.{i}.content")})
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
            out.append({"role": "tool", "content": parts_of(item.output, f"input.{i}.output"),
                        "tool_call_id": item.call_id})
    return out
