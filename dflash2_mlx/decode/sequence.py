"""One sequence in the engine: what it asks for (`Request`), what a step did for it (`Event`),
its record while it runs (`Sequence`), what its sources can draft (`Offer`), its part of a step
(`Plan`), and the commit of its tokens; and what the decode layer asks of the layer above it:
a sequence's width policy (`WidthPolicy`) and the engine's planner (`Planning`), both made in
`policy/` and passed in."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Protocol, runtime_checkable

import mlx.core as mx

from ..model.drafter import Draft, Drafter, Proposal
from .lookup import LookupConfig, LookupIndex
from ..model.sampling import Sampling
from ..model.vision import Media
from .state import DecodeState
from .stats import DRAFTER, LOOKUP, GenerationStats

@runtime_checkable
class WidthPolicy(Protocol):
    """What the planner (`policy.Planner`) asks of a sequence's policy each cycle.
    available: the widest block each source ("drafter", "lookup") can draft now; match_n: the
    lookup's recurring suffix length (0: none); context: the tokens the target's cache holds
    (None: the calibration's short context)."""

    last: tuple[float, float]        # (expected tokens, draft seconds) of its latest choice

    def choose(self, available: dict[str, int], match_n: int = 0, context: int | None = None,
               launched: bool = False) -> tuple[str, int]:
        """(source, width) of this cycle: ("plain", 1) or a source and the rows to verify.
        launched: the cycle is a plain step launched last cycle (a probe waits)."""

    def update(self, source: str, width: int, accepted: int, seconds: float | None = None,
               match_n: int = 0, context: int | None = None, first: int = 1) -> None:
        """A cycle's outcome: drafts accepted, seconds (None: untimed, or a `LookupShadow`'s
        score); first: the first draft position to count."""

    def launch_next(self, choice: tuple[str, int], available: dict[str, int],
                    match_n: int = 0, context: int | None = None) -> bool:
        """Whether this plain step launches the next one before its token is read."""

    def next_plain(self, available: dict[str, int], context: int | None = None) -> bool:
        """Whether the next cycle will be a plain step."""


STOP, LENGTH, CANCELLED = "stop", "length", "cancelled"


@dataclass
class Request:
    """One sequence to generate. policy: its own width policy (`policy.adaptive.FixedWidth`,
    `AdaptiveWidth`, `policy.batch.BatchAwareWidth`; None: plain decoding);
    lookup: draft from its context too; state: a `DecodeState` to start from (advanced in
    place); keep_state: keep its state when it leaves (`Engine.pop_state`); progress(done,
    total): called between the chunks of a long prefill; stats: the record to fill;
    checkpoint: with keep_state, a prompt position whose state is kept too when the state
    cannot be trimmed back to it (recurrent layers): `Engine.pop_checkpoint`; media: the
    prompt's images (`model.vision.Media`: `prompt` then holds each image's key ids in place
    of its placeholder tokens, so the prefix cache tells images apart)."""

    prompt: list[int]
    max_tokens: int = 256
    sampling: Sampling = field(default_factory=Sampling)
    policy: "WidthPolicy | None" = None
    stop_ids: frozenset = frozenset()
    lookup: bool = False
    seed: int | None = None
    state: DecodeState | None = None
    keep_state: bool = False
    progress: Callable[[int, int], object] | None = None
    stats: GenerationStats | None = None
    checkpoint: int | None = None
    media: Media | None = None


@dataclass(frozen=True)
class Event:
    """What a step did for one sequence: the tokens it committed, and why it ended (None:
    it runs on)."""

    id: int
    tokens: list[int]
    finish: str | None = None


class Sequence:
    """A request while the engine runs it: its state, random key, lookup index and the tokens
    generated so far."""

    def __init__(self, rid: int, req: Request, state: DecodeState, key: mx.array,
                 lookup: LookupConfig | None):
        self.id, self.req, self.state, self.key = rid, req, state, key
        self.lookup = lookup
        self.todo = req.prompt[len(state.tokens):]          # prompt ids not yet prefilled
        self.stats = req.stats if req.stats is not None else GenerationStats()
        self.stats.prompt_tokens, self.stats.cached_tokens = len(req.prompt), len(state.tokens)
        self.tokens: list[int] = []
        self.index: LookupIndex | None = None
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


class Offer(NamedTuple):
    """What a sequence's sources can draft this step, for the planner."""

    available: dict[str, int]      # source -> the widest block it can draft now
    match: int                     # length of the context's recurring suffix (0: none)
    guess: list[int] | None        # the lookup's proposal, if it has one
    room: int                      # tokens it may still generate
    context: int                   # the keys every verified row reads
    launched: bool                 # its step is a plain one launched last step


class Drafted(NamedTuple):
    """What the drafter says of a row's draft, for the planner's second look (`Planning.cut`;
    None there for a lookup's or a plain row)."""

    sureness: mx.array | None          # [1, w-1, 2] the block's own sureness (`Proposal`)
    confidence: mx.array | None        # [1, w-1] a confidence head's, where it may be read


class Planning(Protocol):
    """What the engine asks of its planner (`policy.Planner`), passed in by whoever makes the
    engine: `join` and `leave` as sequences come and go, `plan` each step's rows, `learn` what
    the step did."""

    def join(self, rid: int, policy: WidthPolicy | None) -> None: ...

    def leave(self, rid: int) -> None: ...

    def plan(self, rids: list[int], offers: list[Offer],
             slots: int | None) -> tuple[list, bool]: ...

    def cut(self, drafted: list[Drafted | None]) -> list[int]:
        """After the step's drafting: each row's width to verify, at most its planned one."""

    def predictions(self, row: int) -> tuple[float, ...]:
        """Row i's predicted acceptance per drafted position (empty: none), for its stats."""

    def learn(self, T: int, slots: int | None, accepted: list[int], new: list[list[int]],
              seconds: float, was_launched: bool, launches: bool) -> None: ...


def offer(seq: Sequence, drafter: Drafter | None) -> Offer:
    """What `seq` can draft now: the drafter up to its block size, the lookup what its index
    proposes, neither past max_tokens."""
    room = seq.req.max_tokens - len(seq.tokens)
    available = {DRAFTER: min(drafter.args.max_width, room)} if drafter is not None else {}
    lookup, index = seq.lookup, seq.index
    found = index.propose(min(lookup.max_width, room) - 1) if index and room > 1 else None
    match, guess = found or (0, None)
    if guess:
        available[LOOKUP] = min(lookup.max_width, room)
    return Offer(available, match, guess, room, len(seq.state.tokens), seq.launched is not None)


@dataclass
class Plan:
    """A sequence's part of one step: its source and width, its drafts and keys."""

    seq: Sequence
    source: str
    width: int
    drafts: mx.array | None = None             # [1, w-1]
    proposal: Proposal | None = None           # the drafter's (its q, for sampling)
    draft: Draft | None = None                 # what the step's drafter pass drafts for it
    sample_key: mx.array | None = None         # a plain step's
    accept_key: mx.array | None = None         # a drafting step's
    draft_key: mx.array | None = None          # its drafts' (a plain step launched instead)
    drafted: int = 1                           # the width it drafted (`Engine._cut` narrows)


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
