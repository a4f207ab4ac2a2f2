"""Thinking models: the reasoning a model writes between its think markers, split from its
answer as mlx-lm's server splits it, and the switches that turn it on and off per request.

The markers are the ones mlx-lm's `TokenizerWrapper` knows (`has_thinking`, `think_start`,
`think_end`: `<think>`/`</think>` and the other families' own). The split matches on text,
as mlx-lm's `TextStateMachine` does; a template that opens the block in the generation prompt
(Qwen3.5's `<think>\\n`) starts the answer inside it. Tool calls are read from the answer only
(`TextStream` sees the answer text). docs/server.md, "Thinking".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

# efforts that ask for no reasoning (OpenAI `reasoning_effort`, Responses `reasoning.effort`)
NO_EFFORT = ("none", "minimal")


@dataclass(frozen=True)
class Markers:
    """A tokenizer's think markers, as text and as token ids."""
    start: str
    end: str
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer) -> "Markers | None":
        """The markers of an mlx-lm `TokenizerWrapper` that has them; None otherwise."""
        if not getattr(tokenizer, "has_thinking", False):
            return None
        return cls(tokenizer.think_start, tokenizer.think_end,
                   tuple(tokenizer.think_start_tokens), tuple(tokenizer.think_end_tokens))

    def opens_in(self, prompt: Sequence[int]) -> bool:
        """Does the prompt leave a think block open (its last start after its last end)? The
        generation then starts inside it, as mlx-lm's server decides."""
        return self.rfind_start(prompt) > _rfind(prompt, self.end_ids)

    def rfind_start(self, ids: Sequence[int]) -> int:
        """Where the last start marker begins in ids (-1: none)."""
        return _rfind(ids, self.start_ids)


def _rfind(ids: Sequence[int], seq: tuple[int, ...]) -> int:
    n = len(seq)
    for i in range(len(ids) - n, -1, -1):
        if tuple(ids[i:i + n]) == seq:
            return i
    return -1


class ThinkingSplit:
    """Text in, (reasoning?, text) segments out, the markers cut: the text between a start
    and an end marker is reasoning. Text that could be the beginning of the next marker is
    held back until the next delta decides it. The tokens are counted alongside:
    `reasoning_tokens` counts those inside a block, its markers included."""

    def __init__(self, markers: Markers, inside: bool = False):
        self.markers, self.inside = markers, inside
        self.buffer = ""
        self.reasoning_tokens = 0
        self._token_inside = inside
        self._recent: tuple[int, ...] = ()

    def feed(self, delta: str, tokens: Sequence[int] = ()) -> list[tuple[bool, str]]:
        self._count(tokens)
        self.buffer += delta
        out: list[tuple[bool, str]] = []
        while True:
            marker = self.markers.end if self.inside else self.markers.start
            at = self.buffer.find(marker)
            if at < 0:
                keep = _held_back(self.buffer, marker)
                _add(out, self.inside, self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return out
            _add(out, self.inside, self.buffer[:at])
            self.buffer = self.buffer[at + len(marker):]
            self.inside = not self.inside

    def finish(self) -> list[tuple[bool, str]]:
        """The text held back, in the state it was written in."""
        out: list[tuple[bool, str]] = []
        _add(out, self.inside, self.buffer)
        self.buffer = ""
        return out

    def _count(self, tokens: Sequence[int]) -> None:
        m = self.markers
        for t in tokens:
            self._recent = (self._recent + (t,))[-max(len(m.start_ids), len(m.end_ids)):]
            if self._token_inside:
                self.reasoning_tokens += 1
                if self._recent[-len(m.end_ids):] == m.end_ids:
                    self._token_inside = False
            elif self._recent[-len(m.start_ids):] == m.start_ids:
                self.reasoning_tokens += len(m.start_ids)
                self._token_inside = True


def _held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _add(out: list[tuple[bool, str]], reasoning: bool, text: str) -> None:
    if not text:
        return
    if out and out[-1][0] == reasoning:
        out[-1] = (reasoning, out[-1][1] + text)
    else:
        out.append((reasoning, text))


# --------------------------------------------------------------------------- switches

def switch(enabled: bool | None) -> dict:
    """The chat template arguments for a request's thinking switch (None: the server's)."""
    return {} if enabled is None else {"enable_thinking": enabled}


def effort_switch(effort: str | None) -> bool | None:
    """OpenAI's reasoning effort as the switch: "none" and "minimal" turn thinking off, any
    other effort on; None leaves it to the server."""
    if effort is None:
        return None
    return effort not in NO_EFFORT
