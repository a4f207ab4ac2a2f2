"""An exact prefix cache across requests: the `state.DecodeState` (target cache, drafter
context, pending target features) each finished generation leaves behind, found again by the
longest common token prefix with the next prompt.

Bounded by entries and bytes, least recently used out first. Entries are never handed out:
`fetch` returns a copy trimmed to the common prefix, so no request can change another's state.
With a `cache.disk.DiskCache` as second tier, every inserted state is also written to disk
(off this thread) and a fetch takes the longest prefix from either tier. Used from the
scheduler's one worker thread only, hence no locks here.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
import numpy as np

from .disk import DiskCache
from .disk_file import entry_name
from ..decode.state import DecodeState, common_prefix

log = logging.getLogger("dflash2_mlx.cache.prompt")


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0
    prompt_tokens: int = 0
    recomputed: int = 0       # hits that could not be trimmed (recurrent layers) and were dropped
    disk_hits: int = 0        # hits served from the disk tier (counted in `hits` too)

    def to_dict(self) -> dict:
        return {"lookups": self.lookups, "hits": self.hits, "reused_tokens": self.reused_tokens,
                "prompt_tokens": self.prompt_tokens, "recomputed": self.recomputed,
                "disk_hits": self.disk_hits,
                "hit_rate": self.hits / self.lookups if self.lookups else 0.0,
                "token_hit_rate": (self.reused_tokens / self.prompt_tokens
                                   if self.prompt_tokens else 0.0)}


class PromptCache:
    """max_entries: most states kept in RAM (0: none); max_bytes: most bytes they hold
    together (`DecodeState.nbytes`); disk: a second tier (None: RAM only)."""

    def __init__(self, max_entries: int = 8, max_bytes: int = 2 * 2**30,
                 disk: DiskCache | None = None):
        if max_entries < 0 or max_bytes < 0:
            raise ValueError(f"prompt cache bounds must be >= 0, got {max_entries} entries, "
                             f"{max_bytes} bytes")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.disk = disk
        # key -> (state, bytes, its disk file name or None)
        self._entries: OrderedDict[int, tuple[DecodeState, int, str | None]] = OrderedDict()
        self._next = 0
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(size for _, size, _ in self._entries.values())

    def fetch(self, prompt: list[int]) -> tuple[DecodeState | None, int]:
        """A copy of the entry sharing the longest prefix with `prompt[:-1]` (the last prompt
        token is always run: its logits give the first new token), trimmed to that prefix,
        and the prefix length; (None, 0) on a miss. At equal length RAM wins over disk."""
        self.stats.lookups += 1
        self.stats.prompt_tokens += len(prompt)
        head = prompt[:-1]
        ranked = [(common_prefix(state.tokens, head), 1, key, None)
                  for key, (state, _, _) in self._entries.items()]
        if self.disk is not None:
            in_ram = {name for _, _, name in self._entries.values()}
            ids = np.asarray(head, dtype=np.uint32)
            ranked += [(common_prefix(entry.tokens, ids), 0, -1, entry)
                       for entry in self.disk.entries() if entry.name not in in_ram]
        ranked.sort(key=lambda r: r[:3], reverse=True)
        for common, _, key, entry in ranked:
            if common == 0:
                break
            if entry is None:
                state = self._entries[key][0].copy()
            elif entry.exact_only and common < len(entry.tokens):
                state = None         # it could not be trimmed: not worth reading
            else:
                state = self.disk.load(entry)
                if state is None:        # the file did not check out (and is gone)
                    continue
            if state is None or not state.trim(common):
                # a recurrent (GatedDeltaNet) layer or a moved window cannot go back to
                # `common`; only an entry that is an exact prefix of the prompt can serve
                self.stats.recomputed += 1
                log.debug("prefix cache: an entry shares %d of %d prompt tokens but its state "
                          "cannot be trimmed to them (recurrent layers or a moved window): "
                          "trying a shorter entry, else recomputing the prompt",
                          common, len(prompt))
                continue
            if entry is None:
                self._entries.move_to_end(key)
            else:
                self.stats.disk_hits += 1
            self.stats.hits += 1
            self.stats.reused_tokens += common
            log.debug("prefix cache: reusing %d of %d prompt tokens (from %s)", common,
                      len(prompt), "RAM" if entry is None else "disk")
            return state, common
        return None, 0

    def insert(self, state: DecodeState) -> None:
        """Keep `state` (the caller gives it up), and write it to the disk tier. Entries it
        extends are dropped when its caches can be trimmed back to them (it then serves their
        prompts too); entries pushed out of RAM go to disk unless they are there already."""
        if not state.tokens:
            return
        name = None
        if self.disk is not None:
            self.disk.put(state)
            name = entry_name(state.tokens)
        if self.max_entries == 0:
            return
        size = state.nbytes
        if size > self.max_bytes:
            log.debug("prefix cache: a state of %d bytes exceeds --prompt-cache-bytes %d: "
                      "not kept", size, self.max_bytes)
            return
        if all(c.is_trimmable() for c in state.cache):
            for key in [k for k, (s, _, _) in self._entries.items()
                        if len(s.tokens) <= len(state.tokens)
                        and common_prefix(s.tokens, state.tokens) == len(s.tokens)]:
                del self._entries[key]
        self._entries[self._next] = (state, size, name)
        self._next += 1
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            _, (old, _, _) = self._entries.popitem(last=False)
            if self.disk is not None:
                self.disk.put(old)

    def evict(self, nbytes: int) -> int:
        """Drop least recently used RAM entries until `nbytes` are freed or none is left (the
        server's memory budget makes room for a sequence so) -> the bytes freed. Entries go
        to the disk tier, as those an insert pushes out."""
        freed = 0
        while self._entries and freed < nbytes:
            _, (old, size, _) = self._entries.popitem(last=False)
            freed += size
            if self.disk is not None:
                self.disk.put(old)
        return freed

    def close(self) -> None:
        """Finish the disk tier's queued writes (the server calls it once it stops)."""
        if self.disk is not None:
            self.disk.close()
