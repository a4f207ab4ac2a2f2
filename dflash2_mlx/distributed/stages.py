"""The stages of a pipeline: rank 0's target (`ShardedTarget`, the engine's `Target`), the
loop the other ranks run (`Follower`), and what `load(pipeline=)` hands back to each rank
(`Stage`; `FollowerTarget` as `Pipeline.adapter` on ranks > 0).

Every stage runs its layer range through a view of the model (`views.LayerRange`), whose end
is a stand-in: on rank 0 one that sends the hidden state round the ring and returns what comes
back (the forward then applies the final norm and head), elsewhere one that stops the forward
and hands the hidden state out; ranks > 0 also replace the embedding by the received state.
"""

from __future__ import annotations

import copy
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from ..model.row_caches import RaggedRows, batch_refusal
from ..model.target import rollback_error
from ..model.views import (Incoming, KVQuant, LayerRange, Snapshot, StandIn, TargetModel,
                           run_to_stand_in, stop)
from .link import (CLONE, FILTER, FORWARD, FREE, JOIN, KEEP, RELEASE, STOP, Control, Link,
                   PipelineError)
from .plan import StagePlan


class StageCache(list):
    """Rank 0's caches of its own layers (local order), known to the other ranks by `id`.
    A deep copy (`state.DecodeState.copy`) gets a new id, and the other ranks copy theirs;
    when it is garbage-collected they drop theirs."""

    def __init__(self, caches, owner: "ShardedTarget"):
        super().__init__(caches)
        self.owner, self.rows = owner, 0       # rows: what the target has seen (see position)
        self.id = owner._register(self)

    @property
    def position(self) -> int:
        """Rows the target has seen. Attention caches tell it even after someone trimmed them
        directly (`DecodeState.trim`); the other ranks trim theirs to it before a forward."""
        for c in self:
            if c.is_trimmable():
                return c.offset
        return self.rows

    def __deepcopy__(self, memo):
        twin = StageCache([copy.deepcopy(c, memo) for c in self], self.owner)
        twin.rows = self.rows
        self.owner._ops.append((Control(CLONE, twin.id, source=self.id), None))
        return twin


class StageSnapshot(Snapshot):
    """Rolls back rank 0's layers; the other ranks follow from the position sent with the next
    forward."""

    def rollback(self, kept: int, total: int) -> None:
        super().rollback(kept, total)
        self.cache.rows -= total - kept


class ShardedRows(RaggedRows):
    """Rank 0's rows of a batch (the engine's `caches`): `RaggedRows` of rank 0's layers in a
    `StageCache`, whose id names the batch to the other ranks. Each change of the rows is
    queued for them (a control word and its payload, sent before the next forward, in order),
    and they make it to their own `RaggedRows` (`Follower`)."""

    def __init__(self, owner: "ShardedTarget"):
        super().__init__()
        self.owner = owner

    def _queue(self, word: Control, payload: list | None = None) -> None:
        self.owner._ops.append((word, None if payload is None
                                else mx.array(payload, dtype=mx.int32)))

    def join(self, states: list) -> None:
        joining = [s.cache for s in states]       # held: their FREEs follow the JOIN
        super().join(states)
        if not isinstance(self.cache, StageCache):
            self.cache = StageCache(self.cache, self.owner)
        self._queue(Control(JOIN, self.cache.id, len(joining)),
                    [[c.id, c.position] for c in joining])

    def kept(self, keep: list[int], total: int, snapshot=None) -> None:
        super().kept(keep, total, snapshot)
        self._queue(Control(KEEP, self.cache.id, len(keep), total), list(keep))

    def release(self, row: int, state) -> None:
        super().release(row, state)
        state.cache = StageCache(state.cache, self.owner)
        state.cache.rows = len(state.tokens)
        self._queue(Control(RELEASE, state.cache.id, rows=state.cache.rows, position=row,
                            source=self.cache.id))

    def filter(self, stay: list[int]) -> None:
        super().filter(stay)            # none stay: the batch's cache goes, and its FREE
        if stay:
            self._queue(Control(FILTER, self.cache.id, len(stay)), list(stay))


# --------------------------------------------------------------------------- rank 0


class ShardedTarget(TargetModel):
    """`Target` on rank 0 of a pipeline: the embedding, layers [0, k0), the final norm and the
    head run here (and so `embed` / `head` for the drafter); layers [k0, L) on the other ranks.

    `forward(tokens [B, T], cache)` -> (logits [B, T, V], features [B, T, len(layer_ids) * H]).
    """

    def __init__(self, model: nn.Module, plan: StagePlan, link: Link,
                 kv: KVQuant | None = None):
        if not plan.leader:
            raise ValueError("ShardedTarget runs on rank 0; other ranks run Stage.follow()")
        super().__init__(model, kv)
        self.plan, self.link = plan, link
        self.layer_ids = tuple(plan.layer_ids)
        self.range = LayerRange(self, plan.start, plan.end, plan.layer_ids)
        remote = LayerRange(self, plan.end, self.num_layers)    # cache types of the others
        self._remote_unrollable = remote.unrollable(remote.make_cache())
        self._remote_refusal = batch_refusal(remote.make_cache())
        self.remote_features = plan.features_after(plan.size - 1)
        self._view = self.range.view(end=StandIn(self.layers[plan.end - 1], self._round_trip))
        self._ids = 0
        self._ops: list[tuple] = []     # (word, payload): caches and rows for the others
        self._back: mx.array | None = None
        self._cache: StageCache | None = None     # the cache of the forward under way
        self._closed = False
        self.forwards = 0

    # ---- caches: local caches, mirrored on the other ranks under the same id
    def _register(self, cache: StageCache) -> int:
        self._ids += 1
        weakref.finalize(cache, self._ops.append, (Control(FREE, self._ids), None))
        return self._ids

    def make_cache(self) -> StageCache:
        return StageCache(self.range.make_cache(), self)

    def check_rollback(self, cache: list) -> None:
        """`cache` holds rank 0's layers; the other ranks' are of the types their layers make."""
        bad = sorted(set(self.range.unrollable(list(cache))) | set(self._remote_unrollable))
        if bad:
            raise rollback_error(bad)

    def batch_refusal(self) -> str | None:
        return batch_refusal(self.range.make_cache()) or self._remote_refusal

    def batch_rows(self) -> "ShardedRows":
        return ShardedRows(self)

    def snapshot(self, cache: StageCache) -> StageSnapshot:
        return StageSnapshot(self.range, cache)

    # ---- messages
    def _send(self, word: Control, payload: mx.array | None = None) -> None:
        self.link.send_control(word, 1, "sending a step to rank 1", payload)

    def _flush_ops(self) -> None:
        while self._ops:
            self._send(*self._ops.pop(0))

    def _round_trip(self, x: mx.array) -> mx.array:
        """x [B, T, H] after rank 0's layers -> the hidden state after the last layer, and the
        features the other ranks captured (kept for `forward`). The control word goes first,
        back to back with the hidden state: the receivers learn its shape and dtype from it
        (both are known before x is computed)."""
        B, T, H = x.shape
        cache = self._cache
        self._send(Control(FORWARD, cache.id, B, T, cache.position - T, x.dtype))
        self.link.send(x, 1, "sending the hidden state to rank 1", "hidden")
        width = H * (1 + len(self.remote_features))
        back = self.link.recv((B, T, width), x.dtype, self.plan.size - 1,
                              f"waiting for rank {self.plan.size - 1}'s hidden state")
        self._back = back[..., H:]
        return back[..., :H]

    def forward(self, tokens: mx.array, cache: StageCache) -> tuple[mx.array, mx.array | None]:
        self._flush_ops()
        self.forwards += 1
        self._cache = cache
        cache.rows += tokens.shape[1]
        logits = self._view(tokens, cache=list(cache) + [None])
        self._cache = None
        if not self.layer_ids:
            return logits, None
        found = dict(self.range.outputs)
        H = self.hidden_size
        for k, i in enumerate(self.remote_features):
            found[i] = self._back[..., k * H:(k + 1) * H]
        return logits, mx.concatenate([found[i] for i in self.layer_ids], axis=-1)

    def close(self) -> None:
        """Tell the other ranks to stop (idempotent)."""
        if self.plan.size > 1 and not self._closed and not self.link.broken:
            self._closed = True
            self._flush_ops()
            self._send(Control(STOP))


# --------------------------------------------------------------------------- ranks > 0


@dataclass
class _Mirror:
    """A follower's copy of one of rank 0's caches: a sequence's, or a batch's rows."""

    cache: list | None
    rows: int = 0
    last: int = 0                         # rows of the last forward
    snapshot: Snapshot | None = None      # taken before the last forward
    batch: RaggedRows | None = None       # a batch's rows (`ShardedRows` on rank 0)

    @property
    def layers(self) -> list:
        return self.batch.cache if self.batch is not None else self.cache


class Follower:
    """Ranks > 0: run this rank's layers whenever rank 0 asks, until it says stop."""

    def __init__(self, model: nn.Module, plan: StagePlan, link: Link,
                 kv: KVQuant | None = None):
        self.plan, self.link = plan, link
        target = TargetModel(model, kv)
        self.range = LayerRange(target, plan.start, plan.end, plan.layer_ids)
        self.incoming = Incoming()
        self._view = self.range.view(end=StandIn(target.layers[plan.end - 1], stop),
                                     embed=self.incoming)
        self.mirrors: dict[int, _Mirror] = {}
        self.forwards, self.compute_s = 0, 0.0       # this rank's layers: forwards, seconds

    def follow(self) -> None:
        r, n = self.plan.rank, self.plan.size
        prev, nxt = r - 1, (r + 1) % n
        while True:
            word, payload = self.link.recv_control(prev, "waiting for rank 0")
            if nxt != 0:
                self.link.send_control(word, nxt, f"passing a step to rank {nxt}", payload)
            if word.op == STOP:
                return
            if word.op == FREE:
                self.mirrors.pop(word.cache, None)
            elif word.op == CLONE:
                src = self.mirrors.get(word.source)
                self.mirrors[word.cache] = (_Mirror(copy.deepcopy(src.cache), src.rows) if src
                                            else _Mirror(self.range.make_cache()))
            elif word.op == FORWARD:
                m = self.mirrors.get(word.cache)
                if m is None:
                    m = self.mirrors[word.cache] = _Mirror(self.range.make_cache())
                if m.batch is None:
                    self._catch_up(m, word.position)
                m.snapshot = self.range.snapshot(m.layers)
                self._forward(m.layers, word, prev, nxt)
                m.rows, m.last = m.rows + word.rows, word.rows
            else:
                self._rows(word, [] if payload is None else payload.tolist())

    def _rows(self, word: Control, payload: list) -> None:
        """A batch's rows changed on rank 0 (`ShardedRows`): the same change to this rank's."""
        if word.op == JOIN:
            m = self.mirrors.setdefault(word.cache, _Mirror(None, batch=RaggedRows()))
            joining = [self.mirrors[i] for i, _ in payload]
            for j, (_, position) in zip(joining, payload):
                self._catch_up(j, position)
            m.batch.join(joining)
        elif word.op == KEEP:
            m = self.mirrors[word.cache]
            m.batch.kept(payload, word.rows, m.snapshot)
        elif word.op == RELEASE:
            out = self.mirrors[word.cache] = _Mirror(None, word.rows)
            self.mirrors[word.source].batch.release(word.position, out)
        elif word.op == FILTER:
            self.mirrors[word.cache].batch.filter(payload)

    def _catch_up(self, m: _Mirror, position: int) -> None:
        """Drop the rows rank 0 dropped since the last forward (a rejected draft suffix, a
        trimmed prefix cache): rank 0's position is the one broadcast of its decisions."""
        if position > m.rows:
            raise PipelineError(f"pipeline: rank {self.plan.rank} is behind rank 0 ({m.rows} "
                                f"rows, rank 0 {position}); the ranks fell out of step")
        drop = m.rows - position
        if drop:
            keep_last = m.last - drop
            if keep_last >= 0:
                m.snapshot.rollback(keep_last, m.last)
            else:                                     # past the last forward: trims only
                try:
                    self.range.trim(m.cache, drop)
                except RuntimeError as e:
                    raise PipelineError(f"pipeline: {e}") from None
            m.rows, m.last, m.snapshot = position, max(keep_last, 0), None

    def _forward(self, cache: list, word: Control, prev: int, nxt: int) -> None:
        H, B, T = self.plan.hidden_size, word.batch, word.rows
        upstream = self.plan.features_after(self.plan.rank - 1)
        x = self.link.recv((B, T, H * (1 + len(upstream))), word.dtype, prev,
                           f"waiting for rank {prev}'s hidden state")
        tic = time.perf_counter()
        self.incoming.x = x[..., :H]
        h = run_to_stand_in(self._view, mx.zeros((B, T), dtype=mx.uint32), list(cache) + [None])
        parts = ([h] + ([x[..., H:]] if upstream else [])
                 + [self.range.outputs[i] for i in self.range.features])
        out = mx.concatenate(parts, axis=-1) if len(parts) > 1 else h
        mx.eval(out, [c.state for c in cache])
        self.compute_s += time.perf_counter() - tic
        self.link.send(out, nxt, f"sending the hidden state to rank {nxt}", "hidden")
        self.forwards += 1
        if self.forwards % 64 == 0:
            mx.clear_cache()


class FollowerTarget:
    """`Target` on ranks > 0 (what `Pipeline.adapter` is there): the shapes; what generates
    raises, naming what to call instead (rank 0 generates)."""

    def __init__(self, stage: "Stage", hidden_size: int, vocab_size: int, num_layers: int):
        self.stage = stage
        self.hidden_size, self.vocab_size, self.num_layers = hidden_size, vocab_size, num_layers
        self.tappable = num_layers                  # pipelines take no looped stack
        self.layer_ids = tuple(stage.plan.layer_ids)

    def _refuse(self, *args, **kwargs):
        s = self.stage
        raise ValueError(f"rank {s.rank} of {s.size} runs layers {s.plan.start}.."
                         f"{s.plan.end - 1} for rank 0: call pipe.stage.follow() there (rank 0 "
                         "generates)")

    def forward(self, tokens: mx.array, cache: list) -> tuple[mx.array, mx.array | None]:
        self._refuse()

    def make_cache(self) -> list:
        self._refuse()

    def check_rollback(self, cache: list) -> None:
        self._refuse()

    def batch_refusal(self) -> str | None:
        self._refuse()

    def batch_rows(self) -> RaggedRows:
        self._refuse()

    def snapshot(self, cache: list) -> Snapshot:
        self._refuse()

    def embed(self, ids: mx.array) -> mx.array:
        self._refuse()

    def head(self, h: mx.array) -> mx.array:
        self._refuse()

    def head_rows(self, ids: mx.array) -> Callable[[mx.array], mx.array]:
        self._refuse()


# --------------------------------------------------------------------------- each rank


@dataclass
class Stage:
    """This rank's part of a pipeline (`Pipeline.stage`): which layers it runs, and on ranks
    > 0 the loop that runs them. Rank 0 generates (`Pipeline.generate` / `stream`) and calls
    `close()` at the end; every other rank calls `follow()`, which returns when rank 0 closes.
    A server (`serve --pipeline`) does the same: rank 0 serves, the others follow.
    `target`: the `Target` of this rank (rank 0: a `ShardedTarget`; others: a `FollowerTarget`)."""

    plan: StagePlan
    link: Link
    target: ShardedTarget | FollowerTarget | None = None
    follower: Follower | None = None
    weight_mib: list[float] = field(default_factory=list)   # weights each rank holds

    @property
    def rank(self) -> int:
        return self.plan.rank

    @property
    def size(self) -> int:
        return self.plan.size

    @property
    def leader(self) -> bool:
        return self.plan.leader

    @property
    def layers(self) -> range:
        return range(self.plan.start, self.plan.end)

    def follow(self) -> None:
        if self.follower is None:
            raise ValueError("Stage.follow() is for ranks > 0; rank 0 generates")
        self.follower.follow()

    def close(self) -> None:
        """Rank 0: tell the others to stop (also run at exit, so a script or command that
        ends, or fails, never leaves them waiting); a broken link has nobody left to tell."""
        if isinstance(self.target, ShardedTarget):
            try:
                self.target.close()
            except PipelineError:
                pass

    def describe(self) -> dict:
        return {"ranks": self.size, "split": [e - s for s, e in self.plan.bounds],
                "layers": [list(b) for b in self.plan.bounds], "weight_mib": self.weight_mib}


def follow_unless_leader(pipe) -> bool:
    """The hook for commands and servers (`generate --pipeline`, `serve --pipeline`): right
    after `load(..., pipeline=group)`, a rank > 0 serves its layers until rank 0 closes the
    pipeline and this returns True (the caller then returns without output); on rank 0, or
    without a pipeline, it returns False at once and the caller generates or serves (rank 0
    closes at exit, or explicitly with `pipe.stage.close()`)."""
    if pipe.stage is None or pipe.stage.leader:
        return False
    pipe.stage.follow()
    return True
