"""The batch engine's caches: for an attention layer one mlx-lm `BatchKVCache` whose rows keep
their own length, so each row drops its own rejected tail after a verify (a quantized layer's
rows hold mlx-lm's quantized triples: `RaggedQuantizedKVCache`); for a recurrent
(GatedDeltaNet) layer mlx-lm's `ArraysCache` with B rows of state (`RecurrentRows`).

Layout (docs/batching.md): the B rows share one slot axis [B, n_kv, S, D]; every step writes
T slots to every row (the step's widest block; a narrower row is padded on the right). Each
slot has a position per row (`pos`, host numpy [B, S]; -1 marks a hole: a rejected draft, a
padding row, a row joined shorter than the others, a slot past a sliding window). Rope takes
the per-row `offset` (the next position of each row: its token count), and `make_mask` builds
[B, 1, N, S + N] from the positions, so holes are never attended to and a sliding window is a
condition on positions, not on slots. After the forward, `commit(keep)` says how many of the T
slots each row keeps; slots that are holes in every row at the end are trimmed at once, and
holes elsewhere are squeezed out by `compact` when they make up 1/16 of the buffer (a
gather of the kept slots, right-aligned; `model.memory.buffer_slots` counts a row so).

Only the public protocol of the models is used: `update_and_fetch`, `make_mask`, `offset`.

A recurrent layer's state cannot drop rows: after a verify of T rows per row (right-padded, so
the padding went through the recurrence too), `views.Snapshot.rollback_rows` gives the rows
that kept fewer than T their state from before the forward back and re-runs the layer over
their kept inputs.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import (ArraysCache, BatchKVCache, KVCache, QuantizedKVCache,
                                 RotatingKVCache)

from .views import RollbackRotatingKVCache
from .memory import COMPACT_MIN, COMPACT_SHARE

SPARE_ROWS = 4            # a buffer keeps at most 1/4 of its rows (at least 1) past the batch


class RaggedKVCache(BatchKVCache):
    """Rows of different lengths with holes; `window`: a sliding-window layer's size (slots
    no query can see any more become holes)."""

    def __init__(self, batch: int = 0, window: int | None = None):
        super().__init__([0] * batch)
        self.window = window
        self.pos = np.zeros((batch, 0), np.int64)       # [B, S] position of each slot, -1: hole
        self.lengths = np.zeros(batch, np.int64)        # next position of each row
        self.offset = mx.array(self.lengths, dtype=mx.int32)

    @property
    def batch(self) -> int:
        return len(self.lengths)

    # ---- the models' protocol
    def update_and_fetch(self, keys, values):
        """Write the step's T slots of every row in place -> the rows' keys and values so
        far. The buffer may hold more rows than the batch (rows that left: `filter`); a
        buffer out of slots grows by `step` slots, as mlx-lm's, and drops those rows then.
        Rope positions (`offset`) stay put until `commit`."""
        B, _, T, _ = keys.shape
        new = self._encode(keys, values)
        prev, parts = self._idx, self._parts()
        if parts is None or prev + T > parts[0].shape[2]:
            grow = -(-T // self.step) * self.step
            room = [mx.zeros((B, n.shape[1], grow, n.shape[3]), n.dtype) for n in new]
            parts = room if parts is None else [mx.concatenate([p[:B, :, :prev], r], axis=2)
                                                for p, r in zip(parts, room)]
            self._set_parts(parts)
        self._idx = prev + T
        for p, n in zip(parts, new):
            p[:B, :, prev : self._idx] = n
        return self._fetch(B, self._idx)

    # ---- the arrays: keys and values, each [B, n_kv, S, D] (a subclass may split them)
    def _parts(self) -> list | None:
        """Every array of the cache, slot axis 2 (None: nothing written yet)."""
        return None if self.keys is None else [self.keys, self.values]

    def _set_parts(self, parts: list | None) -> None:
        self.keys, self.values = (None, None) if parts is None else parts

    def _encode(self, keys: mx.array, values: mx.array) -> list:
        """A step's keys and values as the parts they are stored in."""
        return [keys, values]

    def _fetch(self, B: int, n: int):
        """What attention reads: the first n slots of the first B rows."""
        return self.keys[:B, :, :n], self.values[:B, :, :n]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None,
                  **kwargs) -> mx.array:
        """[B, 1, N, S + N]: query j of row b (position lengths[b] + j) sees the slots of row b
        whose position is at most its own (and within the window)."""
        q = self.lengths[:, None] + np.arange(N)[None]                     # [B, N]
        k = np.concatenate([self.pos[:, : self._idx], q], axis=1)          # [B, S + N]
        visible = (k[:, None, :] >= 0) & (k[:, None, :] <= q[:, :, None])
        if window_size is not None:
            visible &= q[:, :, None] - k[:, None, :] < window_size
        return mx.array(visible[:, None])

    def is_trimmable(self):
        return False                        # rows go back by `commit`, not by one count

    def trim(self, n):
        raise NotImplementedError("a RaggedKVCache drops rejected rows per row: use commit")

    # ---- per-row rollback
    def commit(self, keep) -> None:
        """After a forward of T rows: row b keeps the first keep[b] of them (0 <= keep[b] <= T),
        the rest become holes."""
        keep = np.asarray(keep, np.int64)
        T = self._idx - self.pos.shape[1]
        if keep.shape != (self.batch,) or T < 0 or (keep < 0).any() or (keep > T).any():
            raise ValueError(f"commit: keep must give 0..{T} rows for each of the "
                             f"{self.batch} rows, got {keep.tolist()}")
        j = np.arange(T)[None]
        new = np.where(j < keep[:, None], self.lengths[:, None] + j, -1)
        self.pos = np.concatenate([self.pos, new], axis=1)
        self.lengths = self.lengths + keep
        self.offset = mx.array(self.lengths, dtype=mx.int32)
        if self.window is not None:       # no later query can see these: free them
            self.pos = np.where(self.pos > self.lengths[:, None] - self.window, self.pos, -1)
        self._drop_trailing_holes()
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        holes = self._idx - int((self.pos >= 0).sum(axis=1).max(initial=0))
        if holes >= max(COMPACT_MIN, self._idx // COMPACT_SHARE):
            self.compact()

    def _drop_trailing_holes(self) -> None:
        used = np.flatnonzero((self.pos >= 0).any(axis=0))
        end = int(used[-1]) + 1 if len(used) else 0
        if end < self._idx:
            self._idx = end
            self.pos = self.pos[:, :end]

    def compact(self) -> None:
        """Squeeze the holes out: each row's kept slots, in order, right-aligned in a buffer as
        long as the longest row (the shorter rows start with holes)."""
        valid = self.pos >= 0
        n = int(valid.sum(axis=1).max(initial=0))
        # holes first, then the kept slots in slot order (a stable sort on the flag)
        order = np.argsort(valid, axis=1, kind="stable")[:, self._idx - n:]
        self.pos = np.take_along_axis(self.pos, order, axis=1)
        parts = self._parts()
        if parts is not None:
            # `step` more columns (any slot's copy: free room) so that the next forward
            # writes in place, not growing the buffer with a second copy of every row
            B = self.batch
            room = np.zeros((B, self.step), order.dtype)
            idx = mx.array(np.concatenate([order, room], axis=1).astype(np.int32))
            idx = idx[:, None, :, None]
            S = n + self.step
            self._set_parts([mx.take_along_axis(
                p[:B, :, : self._idx], mx.broadcast_to(idx, (B, p.shape[1], S, p.shape[3])),
                axis=2) for p in parts])
        self._idx = n

    # ---- rows joining and leaving
    def filter(self, batch_indices) -> None:
        """Keep the given rows, in that order. When at most half the kept rows change place
        (rows that leave, their places filled from the end: `Engine._leave`), only those
        are copied, in place; the buffer keeps the rows past the batch until it grows, up to
        a quarter of the batch (`SPARE_ROWS`: past that, one gather of the rows it keeps; a
        gather of every row, as mlx-lm's filter does, took ~95 ms, about 0.3 of a plain
        step, at 16 rows of 1.2k slots, every time a sequence left)."""
        rows = np.asarray(batch_indices, np.int64)
        moved = np.flatnonzero(rows != np.arange(len(rows)))
        parts = self._parts()
        if parts is not None:
            spare = parts[0].shape[0] - len(rows)
            if len(moved) > len(rows) // 2 or spare > max(1, len(rows) // SPARE_ROWS):
                idx = mx.array(rows.astype(np.int32))
                self._set_parts([p[idx] for p in parts])
            elif len(moved):
                src = mx.array(rows[moved].astype(np.int32))
                copies = [p[src] for p in parts]
                mx.eval(copies)    # read first, then slice writes: they go in place (a
                for j, i in enumerate(moved.tolist()):    # scatter copied the buffer)
                    for p, c in zip(parts, copies):
                        p[i : i + 1] = c[j : j + 1]
        self.pos, self.lengths = self.pos[rows], self.lengths[rows]
        self.offset = mx.array(self.lengths, dtype=mx.int32)
        self.left_padding = mx.zeros((len(rows),), mx.int32)
        if not len(rows):
            self._set_parts(None)
            self._idx, self.pos = 0, np.zeros((0, 0), np.int64)
            return
        self._drop_trailing_holes()
        self._maybe_compact()   # the slots only the departed rows used are holes now

    def extend(self, *others: "RaggedKVCache") -> None:
        """Append the rows of `others`, in order (all right-aligned to the longest slot count),
        in one concatenation: joined one by one, k joiners copied the batch's rows k times
        (16 prompts starting in one step: 1.8 s of copies in the next step)."""
        for o in others:
            if o.window != self.window or o.kind != self.kind:
                raise ValueError(f"cannot join a {o.kind} cache of window {o.window} to a "
                                 f"{self.kind} one of window {self.window}")
        caches = [c for c in (self, *others) if c.batch]
        if len(caches) <= 1:
            if caches and caches[0] is not self:
                self.__dict__.update(vars(caches[0]))
            return
        n = max(c._idx for c in caches)

        def padded(c: RaggedKVCache) -> list:
            # with `step` free slots on the right in the same copy: else the next forward's
            # update_and_fetch grows the buffer, a second copy of every row
            widths = [(0, 0), (0, 0), (n - c._idx, self.step), (0, 0)]
            return [mx.pad(p[: c.batch, :, : c._idx], widths) for p in c._parts()]

        self._set_parts([mx.concatenate(rows) for rows in zip(*map(padded, caches))])
        self.pos = np.concatenate([np.pad(c.pos[:, : c._idx], ((0, 0), (n - c._idx, 0)),
                                          constant_values=-1) for c in caches])
        self.lengths = np.concatenate([c.lengths for c in caches])
        self.offset = mx.array(self.lengths, dtype=mx.int32)
        self.left_padding = mx.zeros((self.batch,), mx.int32)
        self._idx = n

    @staticmethod
    def from_single(cache) -> "RaggedKVCache":
        """One row from a single-sequence cache (mlx-lm's KVCache, QuantizedKVCache -> a
        `RaggedQuantizedKVCache` -, or a sliding-window RotatingKVCache without kept sink
        rows)."""
        if type(cache) is QuantizedKVCache:
            out = RaggedQuantizedKVCache(1, cache.group_size, cache.bits)
            n = cache.offset
            if n:
                out._set_parts([p[..., :n, :] for p in (*cache.keys, *cache.values)])
                out._idx, out.pos = n, np.arange(n)[None]
            out.lengths = np.array([n], np.int64)
            out.offset = mx.array(out.lengths, dtype=mx.int32)
            return out
        if type(cache) is KVCache:
            keys, values, n = cache.keys, cache.values, cache.offset
            out = RaggedKVCache(1)
            if n:
                keys, values = keys[..., :n, :], values[..., :n, :]
            first = 0
        elif isinstance(cache, RotatingKVCache) and cache.keep == 0:
            keys, values, offset, _, max_size, idx = cache.state
            out = RaggedKVCache(1, window=max_size)
            if keys is not None:
                if idx == keys.shape[2]:             # after a multi-row update: in order
                    pass
                elif idx < offset:                   # rotated in place: oldest from idx on
                    keys = mx.concatenate([keys[..., idx:, :], keys[..., :idx, :]], axis=2)
                    values = mx.concatenate([values[..., idx:, :], values[..., :idx, :]],
                                            axis=2)
                else:
                    keys, values = keys[..., :idx, :], values[..., :idx, :]
            n = 0 if keys is None else keys.shape[2]
            first = offset - n
        else:
            raise ValueError(f"the batch engine cannot hold a {type(cache).__name__} "
                             "(attention caches only: KVCache, QuantizedKVCache, "
                             "RotatingKVCache with keep=0)")
        if n:
            out.keys, out.values = keys, values
            out._idx = n
            out.pos = (first + np.arange(n))[None]
        out.lengths = np.array([first + n], np.int64)
        out.offset = mx.array(out.lengths, dtype=mx.int32)
        if out.window is not None:
            out.pos = np.where(out.pos > out.lengths[:, None] - out.window, out.pos, -1)
        return out

    def to_single(self, row: int):
        """Row `row` as a single-sequence cache of the kind `from_single` takes (a
        RollbackRotatingKVCache for a window), holding what the row can still attend to."""
        slots = np.flatnonzero(self.pos[row, : self._idx] >= 0)
        n, length = len(slots), int(self.lengths[row])
        if n and not np.array_equal(self.pos[row, slots], np.arange(length - n, length)):
            raise RuntimeError("a row's kept slots are not its latest positions in order")
        if self.window is None and n != length:
            raise RuntimeError(f"row {row} holds {n} of its {length} positions")
        out = self._single()
        if n:
            idx = mx.array(slots.astype(np.int32))
            parts = [mx.contiguous(p[row : row + 1, :, idx]) for p in self._parts()]
            if self.window is None:
                out.keys, out.values = self._pair(parts)
                out.offset = n
            else:
                out.state = (*parts, length, 0, self.window, n)
        return out

    def row_bytes(self, row: int) -> int:
        """The bytes `to_single(row)` copies: the row's kept slots."""
        parts = self._parts()
        if parts is None:
            return 0
        n = int((self.pos[row, : self._idx] >= 0).sum())
        return n * sum(p.nbytes // (p.shape[0] * p.shape[2]) for p in parts)

    def _single(self):
        """An empty single-sequence cache of the kind `from_single` takes."""
        return KVCache() if self.window is None else RollbackRotatingKVCache(self.window, 0)

    @staticmethod
    def _pair(parts: list) -> tuple:
        """(keys, values) as a single-sequence cache holds them."""
        return tuple(parts)

    def extract(self, idx):
        return self.to_single(idx)

    @classmethod
    def merge(cls, caches):
        rows = [cls.from_single(c) for c in caches]
        out = rows[0]
        out.extend(*rows[1:])
        return out

    def size(self):
        return self._idx

    @property
    def kind(self) -> str:
        return "float"

    @property
    def nbytes(self):
        return sum(p.nbytes for p in self._parts() or ())


class RaggedQuantizedKVCache(RaggedKVCache):
    """`RaggedKVCache` whose keys and values are mlx-lm's quantized triples (packed values,
    scales, biases: [B, n_kv, S, D * bits / 32] and [B, n_kv, S, D / group_size] twice), as
    `QuantizedKVCache` stores them. Each slot is quantized on its own along head_dim when it
    is written, so writing, commit, filter, extend and compaction only move the triples and
    nothing is ever dequantized and quantized again. `bits` and `group_size` make mlx-lm's
    attention take its quantized path, as for `QuantizedKVCache`."""

    def __init__(self, batch: int = 0, group_size: int = 64, bits: int = 8):
        super().__init__(batch)
        self.group_size, self.bits = group_size, bits

    def _parts(self) -> list | None:
        return None if self.keys is None else [*self.keys, *self.values]

    def _set_parts(self, parts: list | None) -> None:
        self.keys, self.values = (None, None) if parts is None else self._pair(parts)

    def _encode(self, keys: mx.array, values: mx.array) -> list:
        return [*mx.quantize(keys, group_size=self.group_size, bits=self.bits),
                *mx.quantize(values, group_size=self.group_size, bits=self.bits)]

    def _fetch(self, B: int, n: int):
        return (tuple(p[:B, :, :n] for p in self.keys),
                tuple(p[:B, :, :n] for p in self.values))

    def _single(self):
        return QuantizedKVCache(self.group_size, self.bits)

    @staticmethod
    def _pair(parts: list) -> tuple:
        return tuple(parts[:3]), tuple(parts[3:])

    @property
    def kind(self) -> str:
        return f"{self.bits}-bit (group size {self.group_size})"


class RecurrentRows(ArraysCache):
    """A recurrent layer's state for B rows: mlx-lm's `ArraysCache` with batch dim B (for
    GatedDeltaNet: the conv state [B, K-1, C] and the recurrent state [B, Hv, Dv, Dk]). It has
    no left padding and no lengths, so `create_ssm_mask` gives None: every row starts at its
    own state, and a verify's padding rows are undone by the rollback."""

    @property
    def batch(self) -> int:
        return self.cache[0].shape[0]

    def filter(self, batch_indices) -> None:
        """Keep the given rows, in that order."""
        super().filter(mx.array(np.asarray(batch_indices, np.int32)))

    def extend(self, *others: "RecurrentRows") -> None:
        """Append the rows of `others`, in order, in one concatenation per state array."""
        for o in others:
            if len(o.cache) != len(self.cache):
                raise ValueError(f"cannot join a recurrent cache of {len(o.cache)} arrays to "
                                 f"one of {len(self.cache)}")
        caches = [c for c in (self, *others) if c.cache[0] is not None]
        if caches:
            self.cache = [mx.concatenate(arrays) for arrays in zip(*(c.cache for c in caches))]

    @classmethod
    def from_single(cls, cache: ArraysCache) -> "RecurrentRows":
        """One row from a single-sequence `ArraysCache` that has seen at least one token."""
        if any(c is None for c in cache.cache):
            raise RuntimeError("a recurrent layer's cache joins the batch only after a prefill")
        out = cls(len(cache.cache))
        out.cache = list(cache.cache)
        return out

    def to_single(self, row: int) -> ArraysCache:
        """Row `row` as the single-sequence `ArraysCache` `from_single` takes (its own arrays,
        not views of the batch's)."""
        out = ArraysCache(len(self.cache))
        out.cache = [mx.contiguous(c[row : row + 1]) for c in self.cache]
        return out

    def row_bytes(self, row: int) -> int:
        """The bytes `to_single(row)` copies."""
        return sum(c.nbytes // c.shape[0] for c in self.cache if c is not None)

    def extract(self, idx):
        return self.to_single(idx)


def _recurrent(cache) -> bool:
    return type(cache) is ArraysCache and cache.left_padding is None and cache.lengths is None


def _attention(cache) -> bool:
    return type(cache) in (KVCache, QuantizedKVCache) or (isinstance(cache, RotatingKVCache)
                                                          and cache.keep == 0)


def batch_cache(single: list) -> list:
    """One row per layer from a single-sequence target cache: a `RaggedKVCache` per attention
    layer (`RaggedQuantizedKVCache` for a quantized one), a `RecurrentRows` per recurrent one;
    ValueError naming the layer's cache type when the batch cannot hold it."""
    return [RecurrentRows.from_single(c) if _recurrent(c) else RaggedKVCache.from_single(c)
            for c in single]


def batch_refusal(single: list) -> str | None:
    """Why some layer's cache cannot join a batch (its requests then decode one at a time),
    or None."""
    bad = sorted({type(c).__name__ for c in single if not (_attention(c) or _recurrent(c))})
    if bad:
        return (f"the batch engine serves attention and GatedDeltaNet (ArraysCache) layers; "
                f"this target has {', '.join(bad)} layers: its "
                "requests decode one at a time")
    return None


class RaggedRows:
    """The engine's caches for a batch: one `RaggedKVCache` or `RecurrentRows` per layer,
    a row per sequence, in the order of the engine's rows."""

    def __init__(self):
        self.cache: list | None = None

    def join(self, states: list) -> None:
        """The sequences' own caches (`DecodeState.cache`) join as rows at the end, in one copy
        of the batch per layer, evaluated now; their states hold no cache meanwhile."""
        rows = [batch_cache(s.cache) for s in states]
        for s in states:
            s.cache = None
        if self.cache is None:
            self.cache, rows = rows[0], rows[1:]
        for layer, c in enumerate(self.cache):
            # a layer at a time, each joiner's copy dropped once it is in: the copies and
            # the old buffers never all live beside the new ones (memory budget)
            c.extend(*[r[layer] for r in rows])
            mx.eval(c.state)
            for r in rows:
                r[layer] = None

    def slots(self) -> int:
        """The keys every row's attention reads."""
        return max(c.size() for c in self.cache)

    def kept(self, keep: list[int], total: int, snapshot=None) -> None:
        """After a forward of `total` rows per row, row b keeps its first keep[b]."""
        for c in self.cache:
            if isinstance(c, RaggedKVCache):
                c.commit(keep)
        if snapshot is not None:
            snapshot.rollback_rows(keep, total)

    def release(self, row: int, state) -> None:
        """Row `row`'s caches back to its sequence's state, as a single sequence's, evaluated
        now: a lazy copy would keep the whole batch buffer alive wherever the state goes (the
        prefix cache: 357 MB held for a 100 MB state, docs/decisions.md)."""
        state.cache = [c.to_single(row) for c in self.cache]
        mx.eval([c.state for c in state.cache])

    def release_bytes(self, row: int) -> int:
        """The bytes `release(row)` copies."""
        return sum(c.row_bytes(row) for c in self.cache)

    def filter(self, stay: list[int]) -> None:
        """Keep these rows, in this order (none: the batch is empty)."""
        if not stay:
            self.cache = None
            return
        for c in self.cache:
            c.filter(stay)
            mx.eval(c.state)        # its old buffer goes now, not beside every other layer's


class SoloRows:
    """The engine's caches for one sequence at a time: the sequence's own, of any kind
    (sliding-window with sink rows, any recurrent one); a snapshot rolls them back."""

    def __init__(self):
        self.cache: list | None = None
        self.state = None

    def join(self, states: list) -> None:
        (self.state,) = states
        self.cache = self.state.cache

    def slots(self) -> int:
        return len(self.state.tokens)

    def kept(self, keep: list[int], total: int, snapshot=None) -> None:
        if snapshot is not None:
            snapshot.rollback(keep[0], total)

    def release(self, row: int, state) -> None:
        pass                              # the state's caches are the ones decoded in

    def release_bytes(self, row: int) -> int:
        return 0

    def filter(self, stay: list[int]) -> None:
        self.cache = self.state = None
