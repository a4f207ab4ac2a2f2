"""The batched engine: one step advances every running sequence, each with its own source
(plain, drafter, lookup) and width, in ONE target forward over all their rows.

A step, for the running sequences s_1..s_B in the rows of the batch cache:
  plan     each sequence's policy picks its source and width w_b, as `engine.generate_tokens`
           does alone (the same calls, the same per-sequence random keys); drafts come from
           the lookup, or from ONE drafter pass for every sequence drafting from it
  verify   the target runs [B, T = max w_b]: row b is [anchor_b, drafts_b, padding]
  accept   per sequence, greedy prefix match or rejection sampling on its own rows
  rollback `RaggedKVCache.commit`: row b keeps its a_b + 1 rows, the rest become holes; a
           recurrent layer's rows that kept fewer than T replay their kept rows from the
           state before the verify (`views.Snapshot.rollback_rows`)
A step whose sequences are all plain, each of which would launch its next plain step alone,
launches the batch's next step before its own tokens are read (mlx-lm's double buffering;
the keys alone launches with; never shared with a joiner).
Before the decode rows, `step(prefill_budget=n)` prefills the waiting sequences for up to n
prompt tokens (chunked; a sequence joins the batch once its prompt is in). A sequence leaves
at a stop token, its max_tokens or `cancel`, and its single-sequence `DecodeState` can be kept
(`Request.keep_state`) for the prefix cache; a `DecodeState` can start a sequence too.

Greedy output equals generating alone token for token (up to the near-ties docs/batching.md
describes: a batched row is not bitwise the single one); seeded sampling draws the same
sample as alone. Layout and measurements: docs/batching.md.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from .batch_cache import RaggedKVCache, batch_cache, check_batchable
from .drafter import Draft, Drafter, Proposal
from .engine import (Cycle, DecodeState, GenerationStats, PlainClock, Step, _choose, _commit,
                     _draft, _launch, _reuse, prefill)
from .lookup import LookupConfig, LookupIndex
from .policy import WidthPolicy
from .policy.adaptive import DRAFTER, LOOKUP, PLAIN, FixedWidth, Shadow
from .policy.batch import BatchAwareWidth, later_sums, plain_beats
from .policy.costs import drafter_pass
from .sampling import Sampling, greedy_accept, rejection_accept
from .target import Target

STOP, LENGTH, CANCELLED = "stop", "length", "cancelled"


@dataclass
class Request:
    """One sequence to generate. policy: its own width policy object (`adaptive.FixedWidth`,
    `AdaptiveWidth`, or `BatchAwareWidth`; default FixedWidth(1), plain decoding); lookup:
    draft from its context too; state: a `DecodeState` to start from (advanced in place);
    keep_state: keep its state when it leaves (`BatchEngine.pop_state`)."""

    prompt: list[int]
    max_tokens: int = 256
    sampling: Sampling = field(default_factory=Sampling)
    policy: WidthPolicy | None = None
    stop_ids: frozenset = frozenset()
    lookup: bool = False
    seed: int | None = None
    state: DecodeState | None = None
    keep_state: bool = False


@dataclass(frozen=True)
class Event:
    """What a step did for one sequence: the tokens it committed, and why it ended (None:
    it runs on)."""

    id: int
    tokens: list[int]
    finish: str | None = None


class _Sequence:
    def __init__(self, rid: int, req: Request, state: DecodeState, key: mx.array,
                 lookup: LookupConfig | None):
        self.id, self.req, self.state, self.key = rid, req, state, key
        self.policy = req.policy if req.policy is not None else FixedWidth(1)
        self.lookup = lookup
        self.todo = req.prompt[len(state.tokens):]          # prompt ids not yet prefilled
        self.stats = GenerationStats(prompt_tokens=len(req.prompt),
                                     cached_tokens=len(state.tokens))
        self.tokens: list[int] = []
        self.index: LookupIndex | None = None
        self.shadow = Shadow(self.policy, LOOKUP)
        self.launched: mx.array | None = None   # the key alone would have launched a plain
        self.logits = None                      # step with (its next step is that one)
        self.tic = time.perf_counter()


@dataclass
class _Ahead:
    """A plain step of every row launched before the step it follows was read: its rows are
    in the cache (as alone, where a launched step's row is in the cache too)."""

    rows: list[_Sequence]                      # the batch's rows when it was launched
    tokens: mx.array                           # [B] uint32
    feats: mx.array | None                     # [B, 1, F]
    waited: float = 0.0                        # seconds waited for it before its step

    def index(self, seq: _Sequence) -> int:
        return next(j for j, s in enumerate(self.rows) if s is seq)

    def take(self, rows: list[_Sequence]) -> tuple[mx.array, mx.array | None]:
        """The tokens and features of `rows` (the launch's rows less those that left)."""
        if len(rows) == len(self.rows):
            return self.tokens, self.feats
        idx = mx.array([self.index(s) for s in rows], dtype=mx.int32)
        return self.tokens[idx], None if self.feats is None else self.feats[idx]


@dataclass
class _Plan:
    seq: _Sequence
    source: str
    width: int
    match: int
    drafts: mx.array | None = None             # [1, w-1]
    proposal: Proposal | None = None
    draft: Draft | None = None                 # what the step's drafter pass drafts for it
    sample_key: mx.array | None = None         # a plain step's
    accept_key: mx.array | None = None         # a drafting cycle's
    draft_key: mx.array | None = None          # its drafts' (a plain step launched instead)
    guess: list[int] | None = None             # a lookup cycle's whole proposal
    want: tuple[int, float, float] = (1, 1.0, 0.0)   # its policy's choice: (width, expected
                                                     # tokens, draft seconds), run or not


class BatchEngine:
    """Continuous batching over one target (and drafter). Drive it from one thread:
    `add(request) -> id`, `step(prefill_budget) -> [Event]`, `cancel(id)`; `running` and
    `waiting` count the sequences in the batch and those still prefilling or queued.

    lookup: the lookup's settings for requests with `lookup=True`. max_batch: the most
    sequences decoding at once (the others wait). prefill_step_size: the prefill's chunk, as
    alone. launch: launch all-plain steps ahead (False: every step synchronous; the same
    tokens either way)."""

    def __init__(self, target: Target, drafter: Drafter | None = None, *,
                 lookup: LookupConfig | None = None, max_batch: int | None = None,
                 prefill_step_size: int = 2048, launch: bool = True):
        check_batchable(target.make_cache())
        self.target, self.drafter = target, drafter
        self.lookup = lookup or LookupConfig()
        self.max_batch, self.prefill_step_size = max_batch, prefill_step_size
        self.launch = launch
        self.keep = drafter.context_window if drafter is not None else None
        self.cache: list | None = None     # RaggedKVCache / RecurrentRows per layer
        self.rows: list[_Sequence] = []               # decoding, in the cache's row order
        self.queue: deque[_Sequence] = deque()        # prefilling (the first) or waiting
        self.states: dict[int, DecodeState] = {}
        self.stats: dict[int, GenerationStats] = {}
        self.history: list[tuple[int, int, float]] = []   # per decode step: sequences,
        self._next = 0                                    # rows verified (B x T), seconds
        self.timings: dict[str, float] | None = None      # a dict: seconds per step section
        self._ahead: _Ahead | None = None                 # the plain step launched last step
        self.launches = 0                                 # plain steps launched ahead
        self.last_prefill = (0, 0.0)                      # the last step's prompt tokens, s
        self._clock = PlainClock()                        # all-plain steps, as alone
        self.vetoed = 0                     # steps whose drafting plain beat (run or launched)

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
        state = _reuse(request.state, list(request.prompt), self.target, self.drafter)
        rid, self._next = self._next, self._next + 1
        seed = request.seed if request.seed is not None else \
            int.from_bytes(os.urandom(4), "little")
        seq = _Sequence(rid, request, state, mx.random.key(seed),
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

    def step(self, prefill_budget: int | None = None,
             started: Callable[[Event], None] | None = None) -> list[Event]:
        """Prefill waiting sequences for up to `prefill_budget` prompt tokens (None: no
        limit; a sequence whose prompt is in joins the batch), then one decode step of every
        running sequence. started: called with the first-token event of each sequence that
        starts and goes on, at once, in place of returning it (a server sends it before the
        join and the decode step: ~0.17 s sooner alone, here)."""
        events: list[Event] = []
        decoded = self._ahead is not None and self._joinable()
        if decoded:                   # the launched step first: a joiner cannot share it
            events.extend(self._decode())
        budget = math.inf if prefill_budget is None else prefill_budget
        joining: list[_Sequence] = []
        tic, prefilled = time.perf_counter(), 0
        while self.queue and budget > 0 and (self.max_batch is None or
                                             len(self.rows) + len(joining) < self.max_batch):
            seq = self.queue[0]
            n = self._prefill(seq, budget)
            budget, prefilled = budget - n, prefilled + n
            self.last_prefill = (prefilled, time.perf_counter() - tic)
            if seq.todo:
                break
            self.queue.popleft()
            first = self._start(seq)
            if first.finish is None:
                joining.append(seq)
            if first.finish is None and started is not None:
                started(first)
            else:
                events.append(first)
        self._join(joining)
        if self.rows and not decoded:
            events.extend(self._decode())
        return events

    # ---- joining
    def _prefill(self, seq: _Sequence, budget: float) -> int:
        """Prefill up to `budget` prompt ids of `seq` -> how many it took. The last chunk is
        `engine.prefill`'s (its last row alone gives the first token's logits)."""
        todo, state = seq.todo, seq.state
        tic = time.perf_counter()
        if len(todo) <= budget:
            seq.logits = prefill(self.target, state, todo, self.prefill_step_size, self.keep)
            n = len(todo)
        else:
            n = int(budget)
            x = mx.array(todo[:n], dtype=mx.uint32)[None]
            for start in range(0, n, self.prefill_step_size):
                _, feats = self.target.forward(x[:, start:start + self.prefill_step_size],
                                               state.cache)
                state.add_features(feats, self.keep)
                mx.eval([c.state for c in state.cache], state.pending)
            state.tokens.extend(todo[:n])
        seq.todo = todo[n:]
        seq.stats.prefill_s += time.perf_counter() - tic
        return n

    def _start(self, seq: _Sequence) -> Event:
        """The first token, from the prefill's logits; the sequence joins the batch."""
        seq.key, k = mx.random.split(seq.key)
        first = seq.req.sampling.sample(seq.logits, k).item()
        seq.logits = None
        seq.tokens = [first]
        if seq.lookup is not None:
            seq.index = LookupIndex(seq.lookup, list(seq.req.prompt) + seq.tokens)
        seq.stats.generated_tokens = 1
        seq.tic = time.perf_counter()
        finish = self._finished(seq)
        if finish is not None:
            self._keep(seq)
            return Event(seq.id, [first], finish)
        return Event(seq.id, [first])

    def _join(self, seqs: list[_Sequence]) -> None:
        """The started sequences' rows join the batch's caches, in one copy of the batch per
        layer, evaluated now: the copy is the joiners' cost, not the next decode step's (whose
        time the policies learn from)."""
        if not seqs:
            return
        rows = [batch_cache(seq.state.cache) for seq in seqs]
        for seq in seqs:
            seq.state.cache = None                    # the rows live in the batch now
        if self.cache is None:
            self.cache, rows = rows[0], rows[1:]
        if rows:
            for c, *joined in zip(self.cache, *rows):
                c.extend(*joined)
        mx.eval([c.state for c in self.cache])
        self.rows.extend(seqs)

    # ---- one decode step
    def _plan(self, seq: _Sequence) -> _Plan:
        """What `generate_tokens` does alone before its verify, for one sequence, but the
        drafter's pass: a drafter plan holds its `draft` for the step's one pass."""
        room = seq.req.max_tokens - len(seq.tokens)
        context = len(seq.state.tokens)
        forced = seq.launched is not None
        choice = _choose(seq.policy, self.drafter, seq.index, seq.lookup, room, context,
                         forced)
        source, width = (PLAIN, 1) if forced else (choice.source, choice.width)
        if source != LOOKUP:
            seq.shadow.offer(choice.guess, choice.match, context)
        seq.key, k_draft, k_accept = mx.random.split(seq.key, 3)
        e, d = getattr(seq.policy, "last", (1.0, 0.0))
        want = (choice.width, e, d if choice.source == DRAFTER else 0.0) \
            if choice.source != PLAIN else (1, 1.0, 0.0)
        if source == PLAIN:
            plan = _Plan(seq, PLAIN, 1, choice.match, draft_key=k_draft, want=want,
                         sample_key=seq.launched if forced else k_accept)
            launch = room > 1 and seq.policy.launch_next(
                (choice.source, choice.width), choice.available, choice.match, context + 1)
            seq.launched = k_draft if launch else None
            return plan
        anchor = mx.array([[seq.tokens[-1]]], dtype=mx.uint32)
        if source == DRAFTER:
            draft = Draft(anchor, seq.state.take_features(), seq.state.dcache, width,
                          seq.req.sampling, k_draft)
            return _Plan(seq, source, width, choice.match, draft=draft, accept_key=k_accept,
                         draft_key=k_draft, want=want)
        proposal = _draft(self.target, self.drafter, seq.state, anchor, choice,
                          seq.req.sampling, k_draft)
        return _Plan(seq, source, width, choice.match, proposal.tokens.astype(mx.uint32),
                     proposal, accept_key=k_accept, draft_key=k_draft, guess=choice.guess,
                     want=want)

    @staticmethod
    def _plain_instead(plans: list[_Plan], contexts: list[int]) -> None:
        """Every drafting plan becomes a plain step sampled with its key (a drafter plan's
        features go back to its state, a lookup's unverified proposal to its shadow)."""
        for i, p in enumerate(plans):
            if p.width == 1:
                continue
            seq = p.seq
            if p.draft is not None and p.draft.feats is not None:
                seq.state.pending.insert(0, p.draft.feats)
            if p.guess:
                seq.shadow.offer(p.guess, p.match, contexts[i])
            plans[i] = _Plan(seq, PLAIN, 1, p.match, sample_key=p.accept_key,
                             draft_key=p.draft_key, want=p.want)

    def _draft_all(self, plans: list[_Plan]) -> None:
        """One drafter pass for every plan drafting from it (their choices are made first:
        no policy reads a draft)."""
        drafting = [p for p in plans if p.draft is not None]
        if not drafting:
            return
        proposals = self.drafter.propose_batch(self.target, [p.draft for p in drafting])
        for p, proposal in zip(drafting, proposals):
            p.proposal, p.drafts, p.draft = proposal, proposal.tokens.astype(mx.uint32), None
        _launch(proposals)

    def _tick(self, section: str, since: float) -> float:
        """Add the seconds since `since` to `timings[section]` (when timing) -> now."""
        now = time.perf_counter()
        if self.timings is not None:
            self.timings[section] = self.timings.get(section, 0.0) + now - since
        return now

    def _decode(self) -> list[Event]:
        tic = time.perf_counter()
        ahead, self._ahead = self._ahead, None
        # batch-aware policies see what the sequences before them chose and how many follow
        plans, planned = [], []
        slots = max(c.size() for c in self.cache)     # the keys every row's attention reads
        contexts = [len(seq.state.tokens) for seq in self.rows]
        later = later_sums([seq.policy for seq in self.rows])    # O(B W), once per step
        for i, seq in enumerate(self.rows):
            if hasattr(seq.policy, "set_batch"):
                seq.policy.set_batch(planned, later[i + 1], slots)
            plans.append(self._plan(seq))
            planned.append(plans[-1].want if plans[-1].width > 1 else (1, 1.0, 0.0))
        plain_wins = plain_beats([(p.seq.policy, p.want) for p in plans], slots)
        if plain_wins and any(p.width > 1 for p in plans):
            self._plain_instead(plans, contexts)
            planned = [(1, 1.0, 0.0)] * len(plans)
            self.vetoed += 1
        self._draft_all(plans)
        t = self._tick("plan", tic)
        T = max(p.width for p in plans)
        if ahead is not None:          # launched last step (all plain, keys as alone): take it
            tokens, feats = ahead.take(self.rows)
        elif T == 1:                   # all plain: every row keeps its one row
            x = mx.array([[p.seq.tokens[-1]] for p in plans], dtype=mx.uint32)
            tokens, feats = self._plain(x, [p.sample_key for p in plans])
        else:
            rows = []
            for p in plans:
                row = [mx.array([[p.seq.tokens[-1]]], dtype=mx.uint32)]
                if p.drafts is not None:
                    row.append(p.drafts)
                if p.width < T:
                    row.append(mx.zeros((1, T - p.width), mx.uint32))
                rows.append(mx.concatenate(row, axis=1) if len(row) > 1 else row[0])
            snapshot = self.target.snapshot(self.cache)    # the recurrent layers' state
            logits, feats = self.target.forward(mx.concatenate(rows), self.cache)  # [B, T, V]
            greedy_ids = (mx.argmax(logits, axis=-1).astype(mx.uint32)
                          if any(p.seq.req.sampling.greedy for p in plans) else None)
            results = [self._accept(i, p, logits, greedy_ids) for i, p in enumerate(plans)]
        # mlx-lm's double buffering: when every sequence would launch its next plain step
        # alone, launch the batch's before reading this one (no joiner can share it). One
        # that ends now by its length runs one row more, discarded: its end must not break
        # the others' chain (at B = 16 the step after such an end timed ~2.5x a steady one,
        # and under load one ends every few steps)
        if T == 1 and self.launch and not self._joinable():
            last = [self._last(p.seq) for p in plans]
            # those that would draft next step, where the batch is better plain, do not
            # break the chain: their next step is launched plain too
            held = [p for p, end in zip(plans, last) if p.seq.launched is None and not end]
            if held and plain_wins and all(p.want[0] > 1 for p in held):
                for p in held:
                    p.seq.launched = p.draft_key
                self.vetoed += 1
            if not all(last) and all(p.seq.launched is not None or end
                                     for p, end in zip(plans, last)):
                self._ahead = self._launch(tokens)
        t = self._tick("build", t)
        if T == 1:
            mx.eval(tokens)
            t = self._tick("eval", t)
            accepted = [0] * len(plans)
            # host values, no array op: one would wait behind the launched step
            results = [(None, mx.array([x], dtype=mx.uint32)) for x in tokens.tolist()]
        else:
            mx.eval(results)
            t = self._tick("eval", t)
            accepted = [int(a.item()) for a, _ in results]
            keep = [a + 1 for a in accepted]
            for c in self.cache:
                if isinstance(c, RaggedKVCache):
                    c.commit(keep)
            snapshot.rollback_rows(keep, T)
            t = self._tick("commit", t)
        seconds = time.perf_counter() - tic + (ahead.waited if ahead is not None else 0.0)
        self.history.append((len(plans), len(plans) * T, seconds))
        alone = seconds if len(plans) == 1 else None        # what a sequence alone learns
        if T == 1:
            seconds = self._clock.plain(seconds, ahead is not None, self._ahead is not None)
            # alone, as `generate_tokens`: a short chain's steps teach no plain price
            alone = seconds if alone is not None and self._clock.long(
                self._ahead is not None) else None
        draft_s = drafter_pass(d for _, _, d in planned)     # its one pass, as calibrated
        timed = {id(s.policy.shared): s.policy for s in self.rows
                 if isinstance(s.policy, BatchAwareWidth)}
        for policy in timed.values():                 # once per shared correction
            policy.observe(len(plans), T, slots, seconds, draft_s,
                           sum(accepted) + len(plans))
        events, leaving = [], []
        for i, (p, a, (_, bonus)) in enumerate(zip(plans, accepted, results)):
            seq = p.seq
            drafts = p.drafts[0, :a].tolist() if a else []
            step = Step(drafts, bonus, None if feats is None or seq.state.dcache is None
                        else feats[i : i + 1])
            new = _commit(seq.state, seq.tokens[-1], step, self.keep, set(seq.req.stop_ids))
            seq.stats.steps.append(Cycle(p.source, p.width, a))
            seq.policy.update(p.source, p.width, a, alone, p.match, contexts[i])
            seq.tokens.extend(new)                # widths never exceed the room left
            if seq.index is not None:
                seq.index.extend(new)
                seq.shadow.follow(p.source, p.width, a, p.guess, p.match, contexts[i])
                seq.shadow.commit(new)
            seq.stats.generated_tokens = len(seq.tokens)
            seq.stats.decode_s = time.perf_counter() - seq.tic
            finish = self._finished(seq)
            if finish is not None:
                leaving.append(i)
            events.append(Event(seq.id, new, finish))
        t = self._tick("sequences", t)
        if leaving:
            self._leave(leaving)
            self._tick("leave", t)
        return events

    def _plain(self, x: mx.array, keys: list) -> tuple[mx.array, mx.array | None]:
        """One plain step of every row on x [B, 1], each row sampled with its key (unused when
        greedy) -> (tokens [B] uint32, features [B, 1, F] or None), not evaluated; the caches
        keep each row's one row at once (no rollback: nothing is rejected)."""
        logits, feats = self.target.forward(x, self.cache)                 # [B, 1, V]
        for c in self.cache:
            if isinstance(c, RaggedKVCache):
                c.commit([1] * len(keys))
        samplings = [seq.req.sampling for seq in self.rows]
        if all(s.greedy for s in samplings):
            return mx.argmax(logits[:, 0], axis=-1).astype(mx.uint32), feats
        tokens = [s.sample(logits[i : i + 1, 0], k).astype(mx.uint32)
                  for i, (s, k) in enumerate(zip(samplings, keys))]
        return mx.concatenate(tokens), feats

    def _launch(self, tokens: mx.array) -> "_Ahead":
        """The next plain step of every row, on this step's tokens [B] (not read yet), each
        sampled with the key its sequence would launch it with alone (`_Sequence.launched`;
        its next `_plan` is forced plain with that key)."""
        keys = [seq.key if seq.launched is None else seq.launched for seq in self.rows]
        nxt, feats = self._plain(tokens[:, None], keys)     # (a last row's key: unused)
        mx.async_eval(nxt)
        self.launches += 1
        return _Ahead(list(self.rows), nxt, feats)

    def _joinable(self) -> bool:
        """Whether a waiting sequence may join at the next step."""
        return bool(self.queue) and (self.max_batch is None or len(self.rows) < self.max_batch)

    def _accept(self, i: int, p: _Plan, logits: mx.array, greedy_ids: mx.array | None):
        """Row i's (accepted drafts a, bonus token [1] or []) on the device."""
        sampling = p.seq.req.sampling
        if p.source == PLAIN:
            if sampling.greedy:
                return mx.array(0), greedy_ids[i, :1]
            return mx.array(0), sampling.sample(logits[i : i + 1, 0], p.sample_key)
        w = p.width
        if sampling.greedy:
            return greedy_accept(p.drafts[0], greedy_ids[i, :w])
        q = p.proposal.dense_q(logits.shape[-1])[0]                              # [w-1, V]
        return rejection_accept(p.drafts[0], sampling.probs(logits[i, :w]), q, p.accept_key)

    # ---- leaving
    @staticmethod
    def _last(seq: _Sequence) -> bool:
        """Whether this step's token is its last by max_tokens (a plain step adds one)."""
        return len(seq.tokens) + 1 >= seq.req.max_tokens

    @staticmethod
    def _finished(seq: _Sequence) -> str | None:
        if seq.tokens[-1] in seq.req.stop_ids:
            return STOP
        return LENGTH if len(seq.tokens) >= seq.req.max_tokens else None

    def _keep(self, seq: _Sequence) -> None:
        if seq.req.keep_state:
            self.states[seq.id] = seq.state

    def _leave(self, rows: list[int]) -> None:
        ahead = self._ahead
        for i in rows:
            seq = self.rows[i]
            if seq.req.keep_state:
                if ahead is not None:     # its launched row is in the cache: as alone, the
                    j = ahead.index(seq)  # state says so
                    seq.state.tokens.append(seq.tokens[-1])
                    seq.state.add_features(None if ahead.feats is None
                                           else ahead.feats[j : j + 1], self.keep)
                seq.state.cache = [c.to_single(i) for c in self.cache]
                self._keep(seq)
        stay = _fill(len(self.rows), rows)
        self.rows = [self.rows[i] for i in stay]
        if not stay:
            self.cache = self._ahead = None
            mx.clear_cache()
            return
        if ahead is not None:     # the moves below wait for it: its time is its step's
            tic = time.perf_counter()
            mx.eval(ahead.tokens)
            ahead.waited += time.perf_counter() - tic
        for c in self.cache:
            c.filter(stay)


def _fill(n: int, leaving: list[int]) -> list[int]:
    """The rows that stay of n when `leaving` leave, in their places but for the leavers'
    places, which the last staying rows fill (so that the caches move only those)."""
    gone = set(leaving)
    k = n - len(gone)
    tail = [i for i in range(n - 1, k - 1, -1) if i not in gone]
    return [tail.pop(0) if i in gone else i for i in range(k)]
