"""An exact prefix cache across requests: the `engine.DecodeState` (target cache, drafter
context, pending target features) each finished generation leaves behind, found again by the
longest common token prefix with the next prompt.

Bounded by entries and bytes, least recently used out first. Entries are never handed out:
`fetch` returns a copy trimmed to the common prefix, so no request can change another's state.
Used from the scheduler's one worker thread only, hence no locks.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from .engine import DecodeState, common_prefix

log = logging.getLogger("dflash2_mlx.prompt_cache")


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0
    prompt_tokens: int = 0
    recomputed: int = 0       # hits that could not be trimmed (recurrent layers) and were dropped

    def to_dict(self) -> dict:
        return {"lookups": self.lookups, "hits": self.hits, "reused_tokens": self.reused_tokens,
                "prompt_tokens": self.prompt_tokens, "recomputed": self.recomputed,
                "hit_rate": self.hits / self.lookups if self.lookups else 0.0,
                "token_hit_rate": (self.reused_tokens / self.prompt_tokens
                                   if self.prompt_tokens else 0.0)}


class PromptCache:
    """max_entries: most states kept (0: the cache is off); max_bytes: most bytes they hold
    together (`DecodeState.nbytes`)."""

    def __init__(self, max_entries: int = 8, max_bytes: int = 2 * 2**30):
        if max_entries < 0 or max_bytes < 0:
            raise ValueError(f"prompt cache bounds must be >= 0, got {max_entries} entries, "
                             f"{max_bytes} bytes")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[int, tuple[DecodeState, int]] = OrderedDict()
        self._next = 0
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self._entries.values())

    def fetch(self, prompt: list[int]) -> tuple[DecodeState | None, int]:
        """A copy of the entry sharing the longest prefix with `prompt[:-1]` (the last prompt
        token is always run: its logits give the first new token), trimmed to that prefix,
        and the prefix length; (None, 0) on a miss."""
        self.stats.lookups += 1
        self.stats.prompt_tokens += len(prompt)
        ranked = sorted(((common_prefix(state.tokens, prompt[:-1]), key)
                         for key, (state, _) in self._entries.items()), reverse=True)
        for common, key in ranked:
            if common == 0:
                break
            state = self._entries[key][0]
            copy = state.copy()
            if not copy.trim(common):
                # a recurrent (GatedDeltaNet) layer or a moved window cannot go back to
                # `common`; only an entry that is an exact prefix of the prompt can serve
                self.stats.recomputed += 1
                log.debug("prefix cache: an entry shares %d of %d prompt tokens but its state "
                          "cannot be trimmed to them (recurrent layers or a moved window): "
                          "trying a shorter entry, else recomputing the prompt",
                          common, len(prompt))
                continue
            self._entries.move_to_end(key)
            self.stats.hits += 1
            self.stats.reused_tokens += common
            log.debug("prefix cache: reusing %d of %d prompt tokens", common, len(prompt))
            return copy, common
        return None, 0

    def insert(self, state: DecodeState) -> None:
        """Keep `state` (the caller gives it up). Entries it extends are dropped when its caches
        can be trimmed back to them (it then serves their prompts too)."""
        if self.max_entries == 0 or not state.tokens:
            return
        size = state.nbytes
        if size > self.max_bytes:
            log.debug("prefix cache: a state of %d bytes exceeds --prompt-cache-bytes %d: "
                      "not kept", size, self.max_bytes)
            return
        if all(c.is_trimmable() for c in state.cache):
            for key in [k for k, (s, _) in self._entries.items()
                        if len(s.tokens) <= len(state.tokens)
                        and common_prefix(s.tokens, state.tokens) == len(s.tokens)]:
                del self._entries[key]
        self._entries[self._next] = (state, size)
        self._next += 1
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            self._entries.popitem(last=False)
