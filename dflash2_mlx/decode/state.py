"""What a sequence's decoding has seen (`DecodeState`: the target's and the drafter's caches
and the tokens they hold) and the prefill that fills it."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import numpy as np

from ..model.drafter import Drafter
from ..model.target import Target
from ..model.vision import MediaRows


@dataclass
class DecodeState:
    """What the target and the drafter have seen: the target's cache over `tokens`, the
    drafter's context cache over the first rows of them, and the target features of the rest
    (`pending`, [1, S_i, F] each), which the drafter reads at its next pass. A generation
    advances it in place; reuse one for a prompt that starts with its tokens (prefix cache)."""

    cache: list
    dcache: list | None
    pending: list = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    @classmethod
    def new(cls, target: Target, drafter: Drafter | None) -> "DecodeState":
        return cls(target.make_cache(), drafter.make_cache() if drafter is not None else None)

    def copy(self) -> "DecodeState":
        """An independent copy (caches are updated in place, so entries must not share them)."""
        return DecodeState(copy.deepcopy(self.cache), copy.deepcopy(self.dcache),
                           list(self.pending), list(self.tokens))

    @property
    def nbytes(self) -> int:
        """Bytes of the target's and the drafter's caches (`cache_nbytes`) and the pending
        features."""
        return (sum(cache_nbytes(c) for c in self.cache + (self.dcache or []))
                + sum(p.nbytes for p in self.pending))

    def trim(self, n: int) -> bool:
        """Keep the first n tokens. False when some cache cannot go back that far (a recurrent
        layer's state, a rotated sliding window, a drafter window that moved past n): the state
        is then unusable and must be dropped."""
        drop = len(self.tokens) - n
        if drop <= 0:
            return drop == 0
        try:
            for c in self.cache:
                if not c.is_trimmable() or c.trim(drop) != drop:
                    return False
        except RuntimeError:            # a rotated sliding-window cache
            return False
        if self.dcache is not None:
            read = self.dcache[0].offset           # context rows the drafter has read
            if n >= read:
                joined = mx.concatenate(self.pending, axis=1) if self.pending else None
                self.pending = [joined[:, : n - read]] if n > read else []
            else:
                if any(n < c.start for c in self.dcache):
                    return False
                for c in self.dcache:
                    c.offset = n
                self.pending = []
        del self.tokens[n:]
        return True

    def add_features(self, feats: mx.array | None, keep: int | None) -> None:
        """Queue target features for the drafter; with a sliding-window drafter keep only the
        `keep` newest rows (older ones are invisible to every block)."""
        if feats is None or self.dcache is None:
            return
        self.pending.append(feats)
        rows = sum(p.shape[1] for p in self.pending)
        if keep is not None and rows > keep:
            self.pending = [mx.concatenate(self.pending, axis=1)[:, rows - keep:]]
            Drafter.skip_context(self.dcache, rows - keep)

    def take_features(self) -> mx.array:
        ctx = mx.concatenate(self.pending, axis=1) if len(self.pending) > 1 else self.pending[0]
        self.pending = []
        return ctx


def cache_nbytes(cache) -> int:
    """Bytes one layer's cache holds (as allocated: a KV cache's buffer grows 256 rows at a
    time): every array of its state; a quantized cache's packed values, scales and biases."""
    return sum(a.nbytes for a in _flat(cache.state))


def _flat(state):
    for s in state if isinstance(state, (list, tuple)) else (state,):
        if isinstance(s, (list, tuple)):
            yield from _flat(s)
        elif isinstance(s, mx.array):
            yield s


def prefill(target: Target, state: DecodeState, ids: list[int], step: int,
            keep: int | None, progress: Callable[[int, int], object] | None = None,
            media: "MediaRows | None" = None, last: bool = True) -> mx.array | None:
    """Run `ids` through the target like mlx-lm does: all but the last in chunks of `step`,
    then the last alone (its logits give the next token) -> logits [1, V] of the last row.
    `progress(done, total)` after each chunk of a prompt longer than one chunk. media: the
    images among these rows (`model.vision.MediaRows`): the target gets their real ids and
    each chunk's `Inputs`. last=False: a part of a prompt, all in chunks -> None."""
    x = mx.array(ids if media is None else media.ids[:len(ids)], mx.uint32)[None]
    end = len(ids) - 1 if last else len(ids)
    bounds = [(s, min(s + step, end)) for s in range(0, end, step)]
    logits = None
    for start, stop in bounds + ([(end, len(ids))] if last else []):
        logits, feats = target.forward(x[:, start:stop], state.cache,
                                       *([] if media is None else [media.inputs(start, stop)]))
        state.add_features(feats, keep)
        if stop < len(ids) or not last:
            mx.eval([c.state for c in state.cache], state.pending)
            mx.clear_cache()
            if progress is not None and len(bounds) > 1:
                progress(stop, len(ids))
    state.tokens.extend(ids)
    return logits[:, -1] if last else None


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two token sequences (lists or arrays)."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n


def reuse(state: DecodeState | None, prompt: list[int], target: Target,
           drafter: Drafter | None) -> DecodeState:
    """`state` trimmed to its longest common prefix with the prompt (leaving at least the last
    prompt token to prefill), or a fresh state when it cannot be trimmed that far."""
    if state is None:
        return DecodeState.new(target, drafter)
    return state if state.trim(common_prefix(state.tokens, prompt[:-1])) else \
        DecodeState.new(target, drafter)
