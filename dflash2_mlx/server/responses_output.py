"""The Responses API's output: the items of one response (`reasoning`, `message`,
`function_call`, `custom_tool_call`) built from `TextStream` pieces, each change also returned
as the typed stream events that describe it, and the Response object around them."""

from __future__ import annotations

import json
import time
import uuid

from .responses_input import FunctionChoice, ResponsesRequest, ToolNames, seal
from .service import finish_reason, openai_tool_calls, usage
from .text_stream import Piece, TextStream

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


def response_status(final: dict, text: TextStream) -> str:
    """completed, or incomplete where the generation reached its token limit."""
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


def response_head(req: ResponsesRequest, model_id: str) -> dict:
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


def response_object(head: dict, status: str, output: list[dict], final: dict | None = None,
                    error: dict | None = None, text: TextStream | None = None) -> dict:
    """The Response object: `head` (`response_head`) with its status, output and usage."""
    done = status in ("completed", "incomplete", "failed")
    return {**head, "status": status, "output": output, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
            else None,
            "completed_at": int(time.time()) if done else None,
            "usage": response_usage(final, text) if final is not None else None}
