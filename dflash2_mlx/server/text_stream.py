"""`TextStream`: what the client sees of the detokenized deltas (reasoning, stop strings, tool
calls), as `Piece`s."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from .. import log as logs
from .thinking import ThinkingSplit

log = logs.get(__name__)


@dataclass
class Piece:
    kind: Literal["text", "tool", "reasoning"]
    text: str = ""
    calls: list[dict] = field(default_factory=list)    # parsed: [{"name", "arguments"}]


class TextStream:
    """Detokenized deltas in, what the client sees out: text up to (not including) the first
    stop string, found across token boundaries, and tool-call spans (between the template's
    start and end markers) cut out and parsed with mlx-lm's parser for the template.

    Text that could be the beginning of a stop string or a tool-call marker is held back until
    the next delta decides it. With `thinking`, the reasoning is split off first (as "reasoning"
    pieces): stop strings and tool calls are looked for in the answer only.
    """

    def __init__(self, stops: list[str] = (), tool_markers: tuple[str, str] | None = None,
                 parse: Callable[[str], Any] | None = None,
                 thinking: ThinkingSplit | None = None):
        self.thinking = thinking
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

    @property
    def reasoning_tokens(self) -> int:
        return self.thinking.reasoning_tokens if self.thinking is not None else 0

    def feed(self, delta: str, tokens: list[int] = ()) -> list[Piece]:
        """The pieces a delta completes (`tokens`: the delta's token ids, to count the
        reasoning tokens)."""
        if self.stopped is not None:
            return []
        if self.thinking is None:
            return self._answer(delta)
        return self._split(self.thinking.feed(delta, tokens))

    def _split(self, segments: list[tuple[bool, str]]) -> list[Piece]:
        out: list[Piece] = []
        for reasoning, text in segments:
            if self.stopped is not None:
                break
            if reasoning:
                out.append(Piece("reasoning", text))
            else:
                out += self._answer(text)
        return out

    def _answer(self, delta: str) -> list[Piece]:
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
        out = (self._split(self.thinking.finish()) if self.thinking is not None
               and self.stopped is None else [])
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

