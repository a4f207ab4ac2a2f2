"""Chat messages (the OpenAI shape every route converts to) into what the model's chat
template can render: system turns where the template takes them, and tools in the prompt for
templates that ignore `tools` (the Hermes format, parsed back by mlx-lm's `json_tools`).
docs/server.md, "Tools" and "System turns"."""

from __future__ import annotations

import json
from typing import Callable

from mlx_lm.tool_parsers import json_tools

TOOL_MARKERS = (json_tools.tool_call_start, json_tools.tool_call_end)
parse_tool_call = json_tools.parse_tool_call

TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query. The "
    "functions, as JSON schemas, one per line within <tools></tools>:\n<tools>\n")
TOOLS_FOOTER = (
    "\n</tools>\n\nTo call a function, answer with a JSON object per call, each within "
    "<tool_call></tool_call> tags:\n<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")

_PROBE = "dflash2_probe_7f3a"


def tools_block(tools: list[dict]) -> str:
    """The tools as the system prompt's last section."""
    return TOOLS_HEADER + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) + \
        TOOLS_FOOTER


def tools_in_text(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Messages for a template that ignores tools: the tools appended to the system prompt,
    each assistant call as a `<tool_call>` line after its text, each tool result a user turn in
    `<tool_response>` tags (adjacent results joined in one turn)."""
    out: list[dict] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                             "arguments": c["function"]["arguments"]},
                                            ensure_ascii=False) + "\n</tool_call>"
                for c in m["tool_calls"])
            text = m.get("content") or ""
            out.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
        elif m["role"] == "tool":
            response = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "tool_results": True})
        else:
            out.append(dict(m))
    for m in out:
        m.pop("tool_results", None)
    if tools:
        block = tools_block(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = (out[0]["content"] + "\n\n" + block) if out[0]["content"] \
                else block
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def fold_system(messages: list[dict]) -> list[dict]:
    """Every system turn after the first message joined into the leading system prompt, in
    order (for templates that take a system turn only at the start)."""
    system = [m["content"] for m in messages if m["role"] == "system" and m["content"]]
    rest = [m for m in messages if m["role"] != "system"]
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + rest


class TemplateTraits:
    """What a chat template renders, found once by rendering probes: `tools` (does the
    `tools=` argument reach the text?) and `system_anywhere` (a system turn after a user turn,
    rendered in place without an error?)."""

    def __init__(self, render: Callable[..., str] | None):
        self.tools = self.system_anywhere = False
        if render is None:               # no template: the plain "role: text" rendering
            self.system_anywhere = True
            return
        tool = {"type": "function", "function": {"name": _PROBE, "description": "",
                                                 "parameters": {"type": "object",
                                                                "properties": {}}}}
        user = {"role": "user", "content": "hi"}
        try:
            self.tools = _PROBE in render([user], tools=[tool])
        except Exception:  # noqa: BLE001 - a template that refuses tools takes none
            self.tools = False
        try:
            text = render([user, {"role": "assistant", "content": "ok"},
                           {"role": "system", "content": _PROBE}, user], tools=None)
            self.system_anywhere = _PROBE in text
        except Exception:  # noqa: BLE001 - a template that refuses it
            self.system_anywhere = False
