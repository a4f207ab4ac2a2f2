"""The draft-verify loop: one step advances every running sequence, each with its own source
(plain, drafter, lookup) and width, in ONE target forward over all their rows. One sequence
is a batch of one.

A step, for the running sequences s_1..s_B:
  plan     the planner (passed in: `policy.Planner`) picks each sequence's source and width w_b
           from what its sources offer; drafts come from the lookup, or from ONE drafter pass
           for every sequence drafting from it
  verify   the target runs [B, T = max w_b]: row b is [anchor_b, drafts_b, padding]
  accept   per sequence, greedy prefix match or rejection sampling on its own rows -> a_b
           accepted drafts and a bonus token
  commit   the caches keep each row's a_b + 1 rows (the target's `batch_rows()` for a batch,
           `model.row_caches.SoloRows` for a sequence alone); the sequences take their tokens
A step whose sequences are all plain may launch the next one before its tokens are read
(mlx-lm's double buffering). Greedy output equals the target's own greedy decoding token for
token; seeded sampling draws the same sample alone or batched. docs/batching.md.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterator

import mlx.core as mx

from ..model.row_caches import SoloRows
from ..model.memory import out_of_memory
from ..model.drafter import Draft, Drafter
from ..model.inputs import Inputs
from ..model.vision import Media
from ..model.target import Target
from .lookup import LookupConfig, LookupIndex
from ..model.sampling import Sampling, greedy_accept, rejection_accept
from .sequence import (CANCELLED, LENGTH, STOP, Drafted, Event, LaunchedStep, Plan, Planning,
                       Request, Sequence, commit, offer)

FAILED = "failed"        # a sequence ended by its own prefill's allocation failure
from .state import DecodeState, prefill, reuse
from .stats import DRAFTER, LOOKUP, PLAIN, Cycle, GenerationStats

__all__ = ["Engine", "Request", "Event", "stream_tokens", "STOP", "LENGTH", "CANCELLED",
           "FAILED"]

CLEAR_EVERY = 256        # tokens of a sequence between frees of MLX's buffer cache


class Engine:
    """The decoding engine over one target (and drafter). Drive it from one thread:
    `add(request) -> id`, `step(prefill_budget) -> [Event]`, `cancel(id)`; or `run(request)`
    for one request to its end. `running` and `waiting` count the sequences decoding and
    those still prefilling or queued.

    planner: what plans each step's rows (`policy.Planner`; `sequence.Planning`).
    lookup: the lookup's settings for requests with `lookup=True`. max_batch: the most
    sequences decoding at once (the others wait); a target whose caches cannot hold ragged
    rows decodes one at a time (`solo_why` says why: `solo_reason`). prefill_step_size: the
    prefill's chunk.
    launch: launch all-plain steps ahead (False: every step synchronous; same tokens).
    isolate_oom: a sequence whose own prefill fails to allocate ends alone, with an Event
    whose finish is FAILED (the error in `failures`), and the step goes on for the others;
    False: the error propagates (the server sets it; docs/server.md, "Memory").
    room_for_state: asked with the bytes a copy would take before a leaving sequence's caches
    are copied out of the batch (or a checkpoint copied) for `keep_state` -> whether to copy
    (the server's memory budget; None: always). Refused, the state is not kept."""

    def __init__(self, target: Target, drafter: Drafter | None = None, *, planner: Planning,
                 lookup: LookupConfig | None = None, max_batch: int | None = None,
                 prefill_step_size: int = 2048, launch: bool = True):
        self.target, self.drafter = target, drafter
        self.solo_why = self.solo_reason(target, max_batch)
        self.solo = self.solo_why is not None
        max_batch = 1 if self.solo else max_batch
        self.caches = SoloRows() if self.solo else target.batch_rows()
        self.lookup = lookup or LookupConfig()
        self.max_batch, self.prefill_step_size = max_batch, prefill_step_size
        self.launch = launch
        self.keep = drafter.context_window if drafter is not None else None
        self.rows: list[Sequence] = []                # decoding, in the caches' row order
        self.queue: deque[Sequence] = deque()         # prefilling (the first) or waiting
        self.states: dict[int, DecodeState] = {}
        self.checkpoints: dict[int, DecodeState] = {}      # rid -> its state at its checkpoint
        self.stats: dict[int, GenerationStats] = {}
        self.history: list[tuple[int, int, float]] = []   # per decode step: sequences,
        self._next = 0                                    # rows verified (B x T), seconds
        self.timings: dict[str, float] | None = None      # a dict: seconds per step section
        self._ahead: LaunchedStep | None = None           # the plain step launched last step
        self.launches = 0                                 # plain steps launched ahead
        self.last_prefill = (0, 0.0)                      # the last step's prompt tokens, s
        self.planner = planner
        self.vetoed = 0                     # steps whose drafting plain beat (run or launched)
        self.isolate_oom = False
        self.room_for_state: Callable[[int], bool] | None = None
        self.failures: dict[int, BaseException] = {}      # id -> why it ended FAILED

    @staticmethod
    def solo_reason(target: Target, max_batch: int | None) -> str | None:
        """Why an engine of `max_batch` on `target` decodes one sequence at a time, or None
        (it batches)."""
        return "max_batch is 1" if max_batch == 1 else target.batch_refusal()

    # ---- the scheduler's interface
    @property
    def running(self) -> int:
        return len(self.rows)

    @property
    def waiting(self) -> int:
        return len(self.queue)

    def add(self, request: Request) -> int:
        if not request.prompt:
            raise ValueError("the prompt is empty: give at least one token")
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {request.max_tokens}")
        state = reuse(request.state, list(request.prompt), self.target, self.drafter)
        if self.solo and (self.drafter is not None or request.lookup):
            self.target.check_rollback(state.cache)
        rid, self._next = self._next, self._next + 1
        seed = request.seed if request.seed is not None else \
            int.from_bytes(os.urandom(4), "little")
        seq = Sequence(rid, request, state, mx.random.key(seed),
                       self.lookup if request.lookup else None)
        self.stats[rid] = seq.stats
        self.queue.append(seq)
        return rid

    def cancel(self, rid: int) -> bool:
        """Drop a sequence now (queued or running); False when it is not here. One cancelled
        during its prefill keeps what it prefilled (`keep_state`): a retry resumes there."""
        for seq in self.queue:
            if seq.id == rid:
                self.queue.remove(seq)
                if seq.req.keep_state and len(seq.state.tokens) > seq.stats.cached_tokens:
                    self._keep(seq)
                return True
        for i, seq in enumerate(self.rows):
            if seq.id == rid:
                self._leave([i])
                return True
        return False

    def pop_state(self, rid: int) -> DecodeState | None:
        """The single-sequence state of a sequence that left with `keep_state`."""
        return self.states.pop(rid, None)

    def pop_checkpoint(self, rid: int) -> DecodeState | None:
        """The state a sequence had at its request's `checkpoint`, when one was kept."""
        return self.checkpoints.pop(rid, None)

    def run(self, request: Request) -> Iterator[Event]:
        """One request to its end on this engine, its events as they come (the first token
        before the first decode step); closing the generator cancels it (its state kept as
        `keep_state` says)."""
        rid = self.add(request)
        try:
            while True:
                for half in (self.admit, self.decode):
                    for ev in half():
                        yield ev
                        if ev.id == rid and ev.finish is not None:
                            return
        finally:
            self.cancel(rid)

    def step(self, prefill_budget: int | None = None,
             started: Callable[[Event], None] | None = None) -> list[Event]:
        """Prefill waiting sequences for up to `prefill_budget` prompt tokens (None: no
        limit; a sequence whose prompt is in joins the batch), then one decode step of every
        running sequence. started: called with the first-token event of each sequence that
        starts and goes on, at once, in place of returning it (a server sends it before the
        join and the decode step)."""
        return self.admit(prefill_budget, started) + self.decode()

    def admit(self, prefill_budget: int | None = None,
              started: Callable[[Event], None] | None = None) -> list[Event]:
        """A step's first half: prefill and join (`step`). None joins while a plain step
        launched last step is in flight (a joiner cannot share it): the step decodes it and
        launches none while a sequence waits, so the joiner comes in at the next."""
        events: list[Event] = []
        if self._ahead is not None:
            return events
        joining = self._prefill_waiting(prefill_budget, events, started)
        if joining:
            self.rows.extend(joining)       # first: a join that fails leaves them in `rows`
            self.caches.join([seq.state for seq in joining])
            for seq in joining:
                self.planner.join(seq.id, seq.req.policy)
        return events

    def decode(self) -> list[Event]:
        """A step's second half: one decode step of every running sequence."""
        return self._decode() if self.rows else []

    # ---- joining
    def _prefill_waiting(self, prefill_budget: int | None, events: list[Event],
                         started: Callable[[Event], None] | None) -> list[Sequence]:
        """Prefill queued sequences in order within the budget -> those that start and go on
        (their first tokens sent to `started`, or added to `events`)."""
        budget = math.inf if prefill_budget is None else prefill_budget
        joining: list[Sequence] = []
        tic, prefilled = time.perf_counter(), 0
        while self.queue and budget > 0 and (self.max_batch is None or
                                             len(self.rows) + len(joining) < self.max_batch):
            seq = self.queue[0]
            try:
                n = self._prefill(seq, budget)
                budget, prefilled = budget - n, prefilled + n
                self.last_prefill = (prefilled, time.perf_counter() - tic)
                if seq.todo:
                    break
                first = self._start(seq)
            except Exception as e:
                if not (self.isolate_oom and out_of_memory(e)):
                    raise
                self._failed(seq, e, events)
                break
            self.queue.popleft()
            if first.finish is None:
                joining.append(seq)
            if first.finish is None and started is not None:
                started(first)
            else:
                events.append(first)
        return joining

    def _failed(self, seq: Sequence, e: BaseException, events: list[Event]) -> None:
        """A sequence's own prefill failed to allocate: it ends (its half-filled state is not
        kept); the batch never held it."""
        self.queue.remove(seq)
        self.failures[seq.id] = e
        seq.state = None
        events.append(Event(seq.id, [], FAILED))
        mx.clear_cache()

    def _prefill(self, seq: Sequence, budget: float) -> int:
        """Prefill up to `budget` prompt ids of `seq` -> how many it took, stopping at its
        request's checkpoint first to keep a copy of the state there (`_checkpoint`)."""
        cut = self._checkpoint(seq)
        if cut is None or cut > budget or cut == len(seq.todo):
            n = self._prefill_ids(seq, budget)
        else:
            n = self._prefill_ids(seq, cut)
            self._checkpoint(seq)
            if budget > n and seq.todo:
                n += self._prefill_ids(seq, budget - n)
        if not seq.todo:
            self._checkpoint(seq)
        return n

    def _checkpoint(self, seq: Sequence) -> int | None:
        """Prompt ids left before the sequence's checkpoint, None when there is none to keep
        (none asked, passed, or a state that can be trimmed back to it: the prefix cache does
        that); at the checkpoint, a copy of the state is kept for `pop_checkpoint`."""
        at, state = seq.req.checkpoint, seq.state
        if (at is None or not seq.req.keep_state or seq.id in self.checkpoints
                or at < len(state.tokens) or at > len(seq.req.prompt)
                or all(c.is_trimmable() for c in state.cache)):
            return None
        if at == len(state.tokens):     # (None: refused room, not asked again)
            self.checkpoints[seq.id] = state.copy() if self._may_copy(state.nbytes) else None
            return None
        return at - len(state.tokens)

    def _prefill_ids(self, seq: Sequence, budget: float) -> int:
        """Prefill up to `budget` prompt ids of `seq` -> how many it took. The last chunk is
        `state.prefill`'s (its last row alone gives the first token's logits)."""
        todo, state = seq.todo, seq.state
        tic = time.perf_counter()
        media = seq.req.media
        n = len(todo) if budget >= len(todo) else int(budget)
        logits = prefill(self.target, state, todo[:n], self.prefill_step_size, self.keep,
                         seq.req.progress if n == len(todo) else None,
                         None if media is None else media.part(len(state.tokens)),
                         last=n == len(todo))
        if n == len(todo):
            seq.logits = logits
        seq.todo = todo[n:]
        if media is not None and not seq.todo:
            media.release()
        seq.stats.prefill_s += time.perf_counter() - tic
        return n

    def _start(self, seq: Sequence) -> Event:
        """The first token, from the prefill's logits."""
        seq.key, k = mx.random.split(seq.key)
        first = seq.req.sampling.sample(seq.logits, k).item()
        seq.logits = None
        seq.tokens = [first]
        if seq.lookup is not None:
            media = seq.req.media       # its real ids: a key id is no vocabulary id
            seq.index = LookupIndex(seq.lookup, list(media.ids if media else seq.req.prompt)
                                    + seq.tokens)
        seq.stats.generated_tokens = 1
        seq.tic = time.perf_counter()
        finish = seq.finished()
        if finish is not None:
            self._keep(seq)
        return Event(seq.id, [first], finish)

    # ---- one decode step
    def _decode(self) -> list[Event]:
        tic = time.perf_counter()
        ahead, self._ahead = self._ahead, None
        slots = self.caches.slots()
        offers = [offer(seq, self.drafter) for seq in self.rows]
        decisions, overruled = self.planner.plan([seq.id for seq in self.rows], offers, slots)
        self.vetoed += overruled
        plans = [self._plan(seq, d, o) for seq, d, o in zip(self.rows, decisions, offers)]
        T = max(p.width for p in plans)
        t = self._tick("plan", tic)
        if T == 1:
            accepted, bonuses, feats = self._plain_step(plans, decisions, ahead)
        else:
            accepted, bonuses, feats = self._drafting_step(plans, T)
        t = self._tick("verify", t)
        seconds = time.perf_counter() - tic + (ahead.waited if ahead is not None else 0.0)
        self.history.append((len(plans), len(plans) * T, seconds))
        events, new, leaving = self._commit_all(plans, accepted, bonuses, feats)
        self.planner.learn(T, slots, accepted, new, seconds, ahead is not None,
                           self._ahead is not None)
        t = self._tick("sequences", t)
        if leaving:
            self._leave(leaving)
            self._tick("leave", t)
        return events

    def _plan(self, seq: Sequence, decision, offered) -> Plan:
        """A row's plan from its decision: its keys (split the same whatever it decided, so a
        sequence samples alike alone and batched) and its drafts (a drafter's left to the
        step's one pass)."""
        seq.key, k_draft, k_accept = mx.random.split(seq.key, 3)
        source, width = decision.source, decision.width
        if source == PLAIN:
            key = k_accept if seq.launched is None else seq.launched
            seq.launched = k_draft if decision.launch else None
            return Plan(seq, PLAIN, 1, sample_key=key, draft_key=k_draft)
        if source == DRAFTER:
            anchor = mx.array([[seq.tokens[-1]]], dtype=mx.uint32)
            draft = Draft(anchor, seq.state.take_features(), seq.state.dcache, width,
                          seq.req.sampling, k_draft)
            return Plan(seq, source, width, draft=draft, accept_key=k_accept, draft_key=k_draft,
                        drafted=width)
        drafts = mx.array([offered.guess[: width - 1]], dtype=mx.uint32)        # [1, w-1]
        return Plan(seq, source, width, drafts, accept_key=k_accept, draft_key=k_draft,
                    drafted=width)

    def _plain_step(self, plans: list[Plan], decisions: list, ahead: LaunchedStep | None):
        """Every row one plain step (the one launched last step, if any), the next one
        launched before this one is read where every row's next step is plain ->
        (accepted, bonus tokens, features)."""
        if ahead is not None:
            tokens, feats = ahead.take(self.rows)
        else:
            tokens, feats = self._plain(
                mx.array([[p.seq.tokens[-1]] for p in plans], dtype=mx.uint32),
                [p.sample_key for p in plans])
        self._launch_next(plans, decisions, tokens)
        mx.eval(tokens)          # read as host values: an array op would wait behind the launch
        return [0] * len(plans), tokens.tolist(), feats

    def _drafting_step(self, plans: list[Plan], T: int):
        """The drafter's one pass, then one verify of every row's [anchor, drafts, padding];
        the caches keep each row's accepted rows -> (accepted, bonus tokens, features)."""
        self._draft_all(plans)
        T = self._cut(plans)
        results, feats, snapshot = self._verify(plans, T)
        mx.eval(results)                                  # the step's one host sync
        accepted = [int(a.item()) for a, _ in results]
        self.caches.kept([a + 1 for a in accepted], T, snapshot)
        return accepted, [int(b.item()) for _, b in results], feats

    def _draft_all(self, plans: list[Plan]) -> None:
        """One drafter pass for every plan drafting from it, started at once: the device
        computes it while Python builds the verify."""
        drafting = [p for p in plans if p.draft is not None]
        if not drafting:
            return
        proposals = self.drafter.propose_batch(self.target, [p.draft for p in drafting])
        for p, proposal in zip(drafting, proposals):
            p.proposal, p.drafts, p.draft = proposal, proposal.tokens.astype(mx.uint32), None
        mx.async_eval([a for p in proposals for a in (p.tokens, p.q, p.confidence, p.sureness)
                       if a is not None])

    def _cut(self, plans: list[Plan]) -> int:
        """The planner's second look, with the drafts in hand (`Planning.cut`): rows narrowed
        to what it keeps, one cut to a single row decoding plainly -> the step's width. Only
        predictions read before any drafted token is drawn reach it where a row samples (a
        confidence head fed the token before each position is read for greedy rows only)."""
        markov = getattr(getattr(self.drafter, "args", None), "confidence_with_markov", False)
        drafted = [None if p.proposal is None else
                   Drafted(p.proposal.sureness, None if markov and not p.seq.req.sampling.greedy
                           else p.proposal.confidence)
                   for p in plans]
        for p, w in zip(plans, self.planner.cut(drafted)):
            if w == 1 and p.width > 1:
                p.source, p.width, p.drafts, p.proposal = PLAIN, 1, None, None
                p.sample_key = p.accept_key
            elif w < p.width:
                p.width, p.drafts = w, p.drafts[:, : w - 1]
                if p.proposal is not None:
                    p.proposal = p.proposal.first(w - 1)
        return max(p.width for p in plans)

    def _verify(self, plans: list[Plan], T: int):
        """The target over every row's [anchor, drafts, padding] [B, T] -> (each row's
        (accepted, bonus) on the device, features [B, T, F] or None, the snapshot that
        rolls the recurrent layers back)."""
        rows = []
        for p in plans:
            row = [mx.array([[p.seq.tokens[-1]]], dtype=mx.uint32)]
            if p.drafts is not None:
                row.append(p.drafts)
            if p.width < T:
                row.append(mx.zeros((1, T - p.width), mx.uint32))
            rows.append(mx.concatenate(row, axis=1) if len(row) > 1 else row[0])
        snapshot = self.target.snapshot(self.caches.cache)
        logits, feats = self.target.forward(mx.concatenate(rows) if len(rows) > 1 else rows[0],
                                            self.caches.cache, *self._shift())   # [B, T, V]
        greedy_ids = (mx.argmax(logits, axis=-1).astype(mx.uint32)
                      if any(p.seq.req.sampling.greedy for p in plans) else None)
        return [self._accept(i, p, logits, greedy_ids) for i, p in enumerate(plans)], \
            feats, snapshot

    @staticmethod
    def _accept(i: int, p: Plan, logits: mx.array, greedy_ids: mx.array | None):
        """Row i's (accepted drafts a, bonus token [1] or []) on the device. A lookup's drafts
        are a point mass (q = None)."""
        sampling = p.seq.req.sampling
        if p.source == PLAIN:
            if sampling.greedy:
                return mx.array(0), greedy_ids[i, :1]
            return mx.array(0), sampling.sample(logits[i : i + 1, 0], p.sample_key)
        w = p.width
        if sampling.greedy:
            return greedy_accept(p.drafts[0], greedy_ids[i, :w])
        q = None if p.source == LOOKUP else p.proposal.dense_q(logits.shape[-1])[0]
        return rejection_accept(p.drafts[0], sampling.probs(logits[i, :w]), q, p.accept_key)

    def _shift(self) -> list:
        """The rows' rope shifts as the forward's extra argument, where one has any (after an
        image under Qwen's multimodal rope: `model.inputs`)."""
        shifts = [0 if s.req.media is None else s.req.media.shift for s in self.rows]
        return [Inputs(shift=shifts[0] if len(shifts) == 1 else mx.array(shifts, mx.int32))
                ] if any(shifts) else []

    def _plain(self, x: mx.array, keys: list) -> tuple[mx.array, mx.array | None]:
        """One plain step of every row on x [B, 1], each row sampled with its key (unused when
        greedy) -> (tokens [B] uint32, features [B, 1, F] or None), not evaluated; the caches
        keep each row's one row at once."""
        logits, feats = self.target.forward(x, self.caches.cache, *self._shift())  # [B, 1, V]
        self.caches.kept([1] * len(keys), 1)
        samplings = [seq.req.sampling for seq in self.rows]
        if all(s.greedy for s in samplings):
            return mx.argmax(logits[:, 0], axis=-1).astype(mx.uint32), feats
        tokens = [s.sample(logits[i : i + 1, 0], k).astype(mx.uint32)
                  for i, (s, k) in enumerate(zip(samplings, keys))]
        return mx.concatenate(tokens) if len(tokens) > 1 else tokens[0], feats

    def _launch_next(self, plans: list[Plan], decisions: list, tokens: mx.array) -> None:
        """mlx-lm's double buffering: when every sequence's next step is plain, launch the
        batch's before reading this one (no joiner can share it). One that ends now by its
        length runs one row more, discarded, so its end does not break the others' chain;
        those the planner holds plain with the batch (`Decision.with_batch`) are launched too."""
        if not self.launch or self._joinable():
            return
        last = [p.seq.last() for p in plans]
        extra = [p for p, d in zip(plans, decisions) if d.with_batch]
        if extra:
            for p in extra:
                p.seq.launched = p.draft_key
            self.vetoed += 1
        if not all(last) and all(p.seq.launched is not None or end
                                 for p, end in zip(plans, last)):
            keys = [seq.key if seq.launched is None else seq.launched for seq in self.rows]
            nxt, feats = self._plain(tokens[:, None], keys)     # (a last row's key: unused)
            mx.async_eval(nxt)
            self.launches += 1
            self._ahead = LaunchedStep(list(self.rows), nxt, feats)

    def _commit_all(self, plans: list[Plan], accepted: list[int], bonuses: list[int],
                    feats: mx.array | None) -> tuple[list[Event], list[list[int]], list[int]]:
        """Each sequence takes its accepted drafts and bonus token -> (events, the tokens each
        committed, the rows that leave)."""
        events, new, leaving = [], [], []
        for i, (p, a, bonus) in enumerate(zip(plans, accepted, bonuses)):
            seq = p.seq
            drafts = p.drafts[0, :a].tolist() if a else []
            rows = None if feats is None or seq.state.dcache is None else feats[i : i + 1]
            tokens = commit(seq, drafts, bonus, rows, self.keep)
            seq.stats.steps.append(Cycle(p.source, p.width, a, p.drafted,
                                         self.planner.predictions(i)))
            before = len(seq.tokens)
            seq.tokens.extend(tokens)                # widths never exceed the room left
            if seq.index is not None:
                seq.index.extend(tokens)
            seq.stats.generated_tokens = len(seq.tokens)
            seq.stats.decode_s = time.perf_counter() - seq.tic
            if len(seq.tokens) // CLEAR_EVERY != before // CLEAR_EVERY:
                mx.clear_cache()
            finish = seq.finished()
            if finish is not None:
                leaving.append(i)
            events.append(Event(seq.id, tokens, finish))
            new.append(tokens)
        return events, new, leaving

    def _tick(self, section: str, since: float) -> float:
        """Add the seconds since `since` to `timings[section]` (when timing) -> now."""
        now = time.perf_counter()
        if self.timings is not None:
            self.timings[section] = self.timings.get(section, 0.0) + now - since
        return now

    def _joinable(self) -> bool:
        """Whether a waiting sequence may join at the next step."""
        return bool(self.queue) and (self.max_batch is None or len(self.rows) < self.max_batch)

    # ---- leaving
    def _keep(self, seq: Sequence) -> None:
        if seq.req.keep_state:
            self.states[seq.id] = seq.state

    def _may_copy(self, nbytes: int) -> bool:
        """Whether a state's copy of `nbytes` may be made (`room_for_state`)."""
        return not nbytes or self.room_for_state is None or self.room_for_state(nbytes)

    def _leave(self, rows: list[int]) -> None:
        ahead = self._ahead
        for i in rows:
            seq = self.rows[i]
            self.planner.leave(seq.id)
            if seq.req.keep_state and self._may_copy(self.caches.release_bytes(i)):
                if ahead is not None:     # its launched row is in the cache: the state says so
                    j = ahead.index(seq)
                    seq.state.tokens.append(seq.tokens[-1])
                    seq.state.add_features(None if ahead.feats is None
                                           else ahead.feats[j : j + 1], self.keep)
                self.caches.release(i, seq.state)
                self._keep(seq)
        stay = _fill(len(self.rows), rows)
        self.rows = [self.rows[i] for i in stay]
        if not stay:
            self.caches.filter([])
            self._ahead = None
            mx.clear_cache()
            return
        if ahead is not None:     # the moves below wait for it: its time is its step's
            tic = time.perf_counter()
            mx.eval(ahead.tokens)
            ahead.waited += time.perf_counter() - tic
        self.caches.filter(stay)


def _fill(n: int, leaving: list[int]) -> list[int]:
    """The rows that stay of n when `leaving` leave, in their places but for the leavers'
    places, which the last staying rows fill (so that the caches move only those)."""
    gone = set(leaving)
    k = n - len(gone)
    tail = [i for i in range(n - 1, k - 1, -1) if i not in gone]
    return [tail.pop(0) if i in gone else i for i in range(k)]


def stream_tokens(target: Target, drafter: Drafter | None, prompt: list[int], *,
                  max_tokens: int, sampling: Sampling, policy, planner: Planning, stop_ids,
                  lookup: LookupConfig | None = None, seed: int | None = None,
                  prefill_step_size: int = 2048, stats: GenerationStats | None = None,
                  state: DecodeState | None = None,
                  progress: Callable[[int, int], object] | None = None,
                  media: Media | None = None) -> Iterator[list[int]]:
    """One prompt alone on an engine of one row: yield the tokens prefill, then each step,
    commits, until a stop token (included) or `max_tokens`. policy: its width policy; planner:
    the engine's (`policy.Planner`); lookup:
    draft from the context too (None: the drafter only); state: the caches of an earlier
    generation to reuse for the prompt's common prefix (advanced in place); stats: filled as
    it goes; progress: `prefill`'s, for long prompts; media: the prompt's images
    (`Request.media`)."""
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    if stats is not None:
        stats.prompt_tokens = len(prompt)
    if max_tokens < 1:
        return
    engine = Engine(target, drafter, planner=planner, lookup=lookup, max_batch=1,
                    prefill_step_size=prefill_step_size)
    request = Request(list(prompt), max_tokens, sampling, policy, frozenset(stop_ids),
                      lookup is not None, seed, state, keep_state=state is not None,
                      progress=progress, stats=stats, media=media)
    for ev in engine.run(request):
        yield ev.tokens
