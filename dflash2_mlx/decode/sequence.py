"""One sequence in the engine: what it asks for (`Request`), what a step did for it (`Event`),
its record while it runs (`Sequence`), its part of a step (`Plan`), and the calls that plan
and commit it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import mlx.core as mx

from ..policy.adaptive import DRAFTER, FixedWidth, LOOKUP, PLAIN, LookupShadow
from ..model.drafter import Draft, Drafter, Proposal
from .lookup import LookupConfig, LookupIndex
from ..policy import WidthPolicy
from .sampling import Sampling
from .state import DecodeState
from .stats import GenerationStats

STOP, LENGTH, CANCELLED = "stop", "length", "cancelled"


@dataclass
class Request:
    """One sequence to generate. policy: its own width policy (`policy.adaptive.FixedWidth`,
    `AdaptiveWidth`, `policy.batch.BatchAwareWidth`; default FixedWidth(1), plain decoding);
    lookup: draft from its context too; state: a `DecodeState` to start from (advanced in
    place); keep_state: keep its state when it leaves (`Engine.pop_state`); progress(done,
    total): called between the chunks of a long prefill; stats: the record to fill."""

    prompt: list[int]
    max_tokens: int = 256
    sampling: Sampling = field(default_factory=Sampling)
    policy: WidthPolicy | None = None
    stop_ids: frozenset = frozenset()
    lookup: bool = False
    seed: int | None = None
    state: DecodeState | None = None
    keep_state: bool = False
    progress: Callable[[int, int], object] | None = None
    stats: GenerationStats | None = None


@dataclass(frozen=True)
class Event:
    """What a step did for one sequence: the tokens it committed, and why it ended (None:
    it runs on)."""

    id: int
    tokens: list[int]
    finish: str | None = None


class Want(NamedTuple):
    """What a sequence's policy chose for a step, run or not: what the batch-aware policies
    of the sequences after it weigh."""

    width: int = 1
    tokens: float = 1.0            # expected tokens committed
    draft_s: float = 0.0           # its drafter pass alone, by the calibration


PLAIN_WANT = Want()


@dataclass(frozen=True)
class Choice:
    """What the width policy chose for a step, and what it chose from."""

    source: str                    # DRAFTER | LOOKUP | PLAIN
    width: int
    available: dict                # source -> the widest block it can draft this step
    match: int                     # length of the context's recurring suffix (0: none)
    guess: list[int] | None        # the lookup's drafts, if it has any


class Sequence:
    """A request while the engine runs it: its state, random key, policy, lookup index and
    the tokens generated so far."""

    def __init__(self, rid: int, req: Request, state: DecodeState, key: mx.array,
                 lookup: LookupConfig | None):
        self.id, self.req, self.state, self.key = rid, req, state, key
        self.policy = req.policy if req.policy is not None else FixedWidth(1)
        self.lookup = lookup
        self.todo = req.prompt[len(state.tokens):]          # prompt ids not yet prefilled
        self.stats = req.stats if req.stats is not None else GenerationStats()
        self.stats.prompt_tokens, self.stats.cached_tokens = len(req.prompt), len(state.tokens)
        self.tokens: list[int] = []
        self.index: LookupIndex | None = None
        self.shadow = LookupShadow(self.policy, LOOKUP)
        # the key of the plain step launched ahead for it (its next step is that one)
        self.launched: mx.array | None = None
        self.logits = None                     # the prefill's last row, until the first token
        self.tic = time.perf_counter()

    def last(self) -> bool:
        """Whether a plain step's token would be its last by max_tokens."""
        return len(self.tokens) + 1 >= self.req.max_tokens

    def finished(self) -> str | None:
        if self.tokens[-1] in self.req.stop_ids:
            return STOP
        return LENGTH if len(self.tokens) >= self.req.max_tokens else None


@dataclass
class Plan:
    """A sequence's part of one step: its source and width, its drafts and keys."""

    seq: Sequence
    source: str
    width: int
    match: int
    want: Want = PLAIN_WANT
    drafts: mx.array | None = None             # [1, w-1]
    proposal: Proposal | None = None           # the drafter's (its q, for sampling)
    draft: Draft | None = None                 # what the step's drafter pass drafts for it
    sample_key: mx.array | None = None         # a plain step's
    accept_key: mx.array | None = None         # a drafting step's
    draft_key: mx.array | None = None          # its drafts' (a plain step launched instead)
    guess: list[int] | None = None             # a lookup step's whole proposal


@dataclass
class LaunchedStep:
    """A plain step of every row, launched before the step it follows was read: its rows are
    in the cache already."""

    rows: list[Sequence]                       # the batch's rows when it was launched
    tokens: mx.array                           # [B] uint32
    feats: mx.array | None                     # [B, 1, F]
    waited: float = 0.0                        # seconds waited for it before its step

    def index(self, seq: Sequence) -> int:
        return next(j for j, s in enumerate(self.rows) if s is seq)

    def take(self, rows: list[Sequence]) -> tuple[mx.array, mx.array | None]:
        """The tokens and features of `rows` (the launch's rows less those that left)."""
        if len(rows) == len(self.rows):
            return self.tokens, self.feats
        idx = mx.array([self.index(s) for s in rows], dtype=mx.int32)
        return self.tokens[idx], None if self.feats is None else self.feats[idx]


def choose(seq: Sequence, drafter: Drafter | None, room: int, context: int,
           launched: bool) -> Choice:
    """The policy's choice for a step (launched: the step is a plain one launched last step,
    whatever the policy says; it keeps a probe for later)."""
    available = {DRAFTER: min(drafter.args.block_size, room)} if drafter is not None else {}
    lookup, index = seq.lookup, seq.index
    found = index.propose(min(lookup.max_width, room) - 1) if index and room > 1 else None
    match, guess = found or (0, None)
    if guess:
        available[LOOKUP] = min(lookup.max_width, room)
    source, width = seq.policy.choose(available, match, context, launched)
    return Choice(source, width, available, match, guess)


def plan(seq: Sequence, drafter: Drafter | None) -> Plan:
    """A sequence's plan for a step, its drafter pass left to the step's one pass (a drafter
    plan holds its `draft`); a plain plan decides whether its next step is launched ahead."""
    room = seq.req.max_tokens - len(seq.tokens)
    context = len(seq.state.tokens)           # the keys every verified row reads
    forced = seq.launched is not None
    choice = choose(seq, drafter, room, context, forced)
    source, width = (PLAIN, 1) if forced else (choice.source, choice.width)
    if source != LOOKUP:
        seq.shadow.offer(choice.guess, choice.match, context)
    seq.key, k_draft, k_accept = mx.random.split(seq.key, 3)
    e, d = seq.policy.last
    want = PLAIN_WANT if choice.source == PLAIN else \
        Want(choice.width, e, d if choice.source == DRAFTER else 0.0)
    if source == PLAIN:
        launch = room > 1 and seq.policy.launch_next(
            (choice.source, choice.width), choice.available, choice.match, context + 1)
        p = Plan(seq, PLAIN, 1, choice.match, want, draft_key=k_draft,
                 sample_key=seq.launched if forced else k_accept)
        seq.launched = k_draft if launch else None
        return p
    anchor = mx.array([[seq.tokens[-1]]], dtype=mx.uint32)
    if source == DRAFTER:
        draft = Draft(anchor, seq.state.take_features(), seq.state.dcache, width,
                      seq.req.sampling, k_draft)
        return Plan(seq, source, width, choice.match, want, draft=draft, accept_key=k_accept,
                    draft_key=k_draft)
    drafts = mx.array([choice.guess[: width - 1]], dtype=mx.uint32)           # [1, w-1]
    return Plan(seq, source, width, choice.match, want, drafts, accept_key=k_accept,
                draft_key=k_draft, guess=choice.guess)


def commit(seq: Sequence, accepted: list[int], bonus: int, feats: mx.array | None,
           keep: int | None) -> list[int]:
    """The anchor and the accepted drafts join the state's rows (features: rows 0..a) -> the
    tokens the step adds: the drafts and the bonus, cut after a stop token."""
    state = seq.state
    new = accepted + [bonus]
    state.tokens.extend([seq.tokens[-1]] + accepted)
    state.add_features(None if feats is None else feats[:, : len(accepted) + 1], keep)
    stop_at = next((i for i, t in enumerate(new) if t in seq.req.stop_ids), None)
    return new if stop_at is None else new[: stop_at + 1]


class PlainStepTimer:
    """Times plain steps across launch chains. A step that launches the next one reads its
    token only after the launched graph has run too, and the launched step then takes almost
    none: each plain step is reported as the mean of its chain so far, the launched step
    counted, so a chain reads as the steps of equal cost it is (docs/decisions.md)."""

    def __init__(self):
        self.seconds, self.steps = 0.0, 0

    def plain(self, seconds: float, was_launched: bool, launches: bool) -> float:
        """A plain step took `seconds`; was_launched: launched by the step before; launches:
        it launched the next one -> the seconds to report for it."""
        if not was_launched:
            self.seconds, self.steps = 0.0, 0
        self.seconds, self.steps = self.seconds + seconds, self.steps + 1
        return self.seconds / (self.steps + launches)

    def long(self, launches: bool) -> bool:
        """Whether the chain of the step just reported is long enough (`TRUSTED_CHAIN`) to say
        what plain decoding costs: a short chain's steps each pay its unhidden start."""
        return self.steps + launches >= TRUSTED_CHAIN


# From this many steps a chain's mean step is what plain decoding costs (its start, about a
# step unhidden, then weighs 1/8 or less)
TRUSTED_CHAIN = 8
