"""The draft-verify loop, as a generator of committed token lists.

One cycle, with committed tokens x_1..x_n and the anchor x_n not yet seen by the target:
  choose    the width policy picks the source of the drafts and the width w (w = 1: a plain
            decoding step, no drafts)
  draft     drafter: [x_n, M, ..., M] (w rows) -> d_1..d_{w-1} in one parallel pass;
            lookup: the w-1 tokens that followed the latest earlier occurrence of the
            context's longest recurring suffix
  verify    the target runs [x_n, d_1, ..., d_{w-1}] and gives w rows of logits and features
  accept    greedy prefix match or rejection sampling (q: the drafter's distribution, or a
            point mass on each lookup token) -> a accepted drafts and one bonus token
  rollback  the snapshot taken before the verify drops the w-1-a rejected rows; rows 0..a of
            the features join the drafter's context
Everything but one host sync per cycle (reading a and the tokens) stays on the device; the
drafts are computed asynchronously while the verify graph is being built.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import mlx.core as mx
import numpy as np

from .policy.adaptive import DRAFTER, LOOKUP, PLAIN, PositionCounts, Shadow
from .drafter import Drafter, Proposal
from .lookup import LookupConfig, LookupIndex
from .sampling import Sampling, greedy_accept, rejection_accept
from .target import Target


@dataclass(frozen=True)
class Cycle:
    source: str          # DRAFTER | LOOKUP | PLAIN
    width: int           # rows verified
    accepted: int        # drafts accepted (0 for a plain step)


@dataclass
class GenerationStats:
    """Figures of one generation. Times in seconds; tau counts the bonus token. A drafting
    cycle is one whose drafts came from the drafter or the lookup; plain steps are the rest."""

    block_size: int | str = 0            # the width setting of this generation, or "auto"
    prompt_tokens: int = 0
    cached_tokens: int = 0               # prompt tokens whose caches were reused, not prefilled
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    steps: list[Cycle] = field(default_factory=list)     # every step after prefill

    def drafting(self, source: str | None = None) -> list[Cycle]:
        return [c for c in self.steps if c.source != PLAIN and source in (None, c.source)]

    @property
    def cycles(self) -> int:
        return len(self.drafting())

    @property
    def accepted(self) -> list[int]:
        return [c.accepted for c in self.drafting()]

    @property
    def widths(self) -> list[int]:
        return [c.width for c in self.drafting()]

    def source_tau(self, source: str | None = None) -> float | None:
        """Mean accepted drafts + 1 per drafting cycle of `source` (None: any); None if none."""
        cycles = self.drafting(source)
        return sum(c.accepted + 1 for c in cycles) / len(cycles) if cycles else None

    @property
    def tau(self) -> float:
        """Mean acceptance length over all drafting cycles (1.0: nothing was drafted)."""
        tau = self.source_tau()
        return 1.0 if tau is None else tau

    @property
    def mean_width(self) -> float:
        """Mean rows verified per step, plain steps included."""
        return sum(c.width for c in self.steps) / len(self.steps) if self.steps else 1.0

    @property
    def decode_tps(self) -> float:
        """Tokens per second after the first token (which prefill produces)."""
        return (self.generated_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    def position_acceptance(self, source: str | None = None) -> list[float | None]:
        """P(draft k accepted | drafts < k accepted), k = 1..widest - 1; None where untried."""
        cycles = self.drafting(source)
        counts = PositionCounts(max((c.width for c in cycles), default=1) - 1)
        for c in cycles:
            counts.update(c.width, c.accepted)
        return counts.rates()

    def copy(self) -> "GenerationStats":
        return replace(self, steps=list(self.steps))

    def to_dict(self) -> dict:
        cycles = self.drafting()
        return {
            "block_size": self.block_size, "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens, "generated_tokens": self.generated_tokens,
            "prefill_s": self.prefill_s, "decode_s": self.decode_s,
            "decode_tps": self.decode_tps, "steps": len(self.steps),
            "plain_steps": len(self.steps) - len(cycles), "cycles": len(cycles),
            "cycles_drafter": len(self.drafting(DRAFTER)),
            "cycles_lookup": len(self.drafting(LOOKUP)),
            "tau": self.tau, "tau_drafter": self.source_tau(DRAFTER),
            "tau_lookup": self.source_tau(LOOKUP), "mean_width": self.mean_width,
            "sources": [c.source for c in cycles], "widths": [c.width for c in cycles],
            "accepted_per_cycle": [c.accepted for c in cycles],
            "position_acceptance": self.position_acceptance(),
            "position_acceptance_drafter": self.position_acceptance(DRAFTER),
            "position_acceptance_lookup": self.position_acceptance(LOOKUP),
        }


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
        arrays = [a for c in self.cache + (self.dcache or []) for a in _flat(c.state)]
        return sum(a.nbytes for a in arrays + self.pending)

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


def _flat(state):
    for s in state if isinstance(state, (list, tuple)) else (state,):
        if isinstance(s, (list, tuple)):
            yield from _flat(s)
        elif isinstance(s, mx.array):
            yield s


def prefill(target: Target, state: DecodeState, ids: list[int], step: int,
            keep: int | None, progress: Callable[[int, int], object] | None = None) -> mx.array:
    """Run `ids` through the target like mlx-lm does: all but the last in chunks of `step`,
    then the last alone (its logits give the next token) -> logits [1, V] of the last row.
    `progress(done, total)` after each chunk of a prompt longer than one chunk."""
    x = mx.array(ids, dtype=mx.uint32)[None]
    bounds = [(s, min(s + step, len(ids) - 1)) for s in range(0, len(ids) - 1, step)]
    for start, end in bounds + [(len(ids) - 1, len(ids))]:
        logits, feats = target.forward(x[:, start:end], state.cache)
        state.add_features(feats, keep)
        if end < len(ids):
            mx.eval([c.state for c in state.cache], state.pending)
            mx.clear_cache()
            if progress is not None and len(bounds) > 1:
                progress(end, len(ids))
    state.tokens.extend(ids)
    return logits[:, -1]


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two token sequences (lists or arrays)."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n


def _reuse(state: DecodeState | None, prompt: list[int], target: Target,
           drafter: Drafter | None) -> DecodeState:
    """`state` trimmed to its longest common prefix with the prompt (leaving at least the last
    prompt token to prefill), or a fresh state when it cannot be trimmed that far."""
    if state is None:
        return DecodeState.new(target, drafter)
    return state if state.trim(common_prefix(state.tokens, prompt[:-1])) else \
        DecodeState.new(target, drafter)


@dataclass(frozen=True)
class Choice:
    """What the width policy chose for a cycle, and what it chose from."""

    source: str                    # DRAFTER | LOOKUP | PLAIN
    width: int
    available: dict                # source -> the widest block it can draft this cycle
    match: int                     # length of the context's recurring suffix (0: none)
    guess: list[int] | None        # the lookup's drafts, if it has any


@dataclass(frozen=True)
class Step:
    """What one step commits: `accepted` drafts (ids), the target's next token `bonus` ([1],
    possibly not yet computed) and the features of every row it verified."""

    accepted: list[int]
    bonus: mx.array
    feats: mx.array | None


def _choose(policy, drafter: Drafter | None, index: LookupIndex | None,
            lookup: LookupConfig | None, room: int, context: int,
            launched: bool = False) -> Choice:
    """The policy's choice for a cycle (launched: the cycle is a plain step launched last
    cycle, whatever the policy says; it keeps a probe for later)."""
    available = {DRAFTER: min(drafter.args.block_size, room)} if drafter is not None else {}
    found = index.propose(min(lookup.max_width, room) - 1) if index and room > 1 else None
    match, guess = found or (0, None)
    if guess:
        available[LOOKUP] = min(lookup.max_width, room)
    source, width = policy.choose(available, match, context, launched)
    return Choice(source, width, available, match, guess)


class PlainClock:
    """Times plain steps across launches. A step that launches the next one reads its token
    only after the launched graph has run too (it takes two steps' time), and the launched
    step then takes almost none: timed one by one, the policy saw plain steps alternate
    between ~2x and ~0x their cost, and its choices flapped with them (each flap broke a
    launch chain). Each plain step is reported as the mean of its launch chain so far, the
    launched step counted, so a chain reads as the steps of equal cost it is."""

    def __init__(self):
        self.seconds, self.steps = 0.0, 0

    def plain(self, seconds: float, was_launched: bool, launches: bool) -> float:
        """A plain step took `seconds`; was_launched: it was launched by the step before;
        launches: it launched the next one -> the seconds to report for it."""
        if not was_launched:
            self.seconds, self.steps = 0.0, 0
        self.seconds, self.steps = self.seconds + seconds, self.steps + 1
        return self.seconds / (self.steps + launches)

    def long(self, launches: bool) -> bool:
        """Whether the chain of the step just reported (`plain`) is long enough to say what
        plain decoding costs (`TRUSTED_CHAIN`). Plain steps between drafting cycles do not:
        each pays its chain's unhidden start (measured with the embedded pair: a 5-step chain
        after a drafter cycle reported 74-84 ms a step, a long one ~65); a policy that learnt
        plain steps from those priced plain decoding like a 2-row drafter cycle and kept
        drafting at a loss (the load benchmark's chat x 1: 140 drafter cycles at tau 1.19).
        Until a long chain runs, the calibrated chain's price stands (`CostModel.plain`)."""
        return self.steps + launches >= TRUSTED_CHAIN


# From this many steps, a chain's mean step is what plain decoding costs (its start, about a
# step unhidden, then weighs 1/8 or less)
TRUSTED_CHAIN = 8


def _plain_step(target: Target, state: DecodeState, anchor: mx.array, ahead: tuple | None,
                launch: bool, sampling: Sampling, key: mx.array, next_key: mx.array
                ) -> tuple[Step, tuple | None]:
    """One plain decoding step on `anchor` [1, 1], or the one launched last step (`ahead`:
    (feats, token)) -> (its Step, the next step launched now or None). launch: the next step
    will be plain too: mlx-lm's double buffering, it is launched before this one's token is
    read, so building its graph overlaps computing."""
    if ahead is None:
        logits, feats = target.forward(anchor, state.cache)                    # [1, 1, V]
        bonus = sampling.sample(logits[:, -1], key)
    else:
        feats, bonus = ahead
    if not launch:
        return Step([], bonus, feats), None
    logits, nxt_feats = target.forward(bonus.reshape(1, 1).astype(mx.uint32), state.cache)
    nxt = (nxt_feats, sampling.sample(logits[:, -1], next_key))
    mx.async_eval(nxt[1])
    return Step([], bonus, feats), nxt


def _draft(target: Target, drafter: Drafter | None, state: DecodeState, anchor: mx.array,
           choice: Choice, sampling: Sampling, key: mx.array) -> Proposal:
    """w-1 drafts after `anchor` from the chosen source."""
    w = choice.width
    if choice.source == DRAFTER:
        proposal = drafter.propose(target, anchor, state.take_features(), state.dcache, w,
                                   sampling, key)
        _launch([proposal])
        return proposal
    ids = mx.array([choice.guess[: w - 1]], dtype=mx.uint32)                  # [1, w-1]
    return Proposal(ids, mx.ones((1, w - 1, 1)), ids[..., None])              # q: 1


def _launch(proposals: list[Proposal]) -> None:
    """Start drafting now: the device computes while Python builds the verify."""
    mx.async_eval([a for p in proposals for a in (p.tokens, p.q) if a is not None])


def _speculate(target: Target, drafter: Drafter | None, state: DecodeState, anchor: mx.array,
               choice: Choice, sampling: Sampling, draft_key: mx.array,
               accept_key: mx.array) -> Step:
    """One drafting cycle: draft, verify [anchor, drafts] in one target forward, accept a
    prefix of the drafts and a bonus token, roll the target's cache back to the kept rows."""
    proposal = _draft(target, drafter, state, anchor, choice, sampling, draft_key)
    drafts = proposal.tokens.astype(mx.uint32)                                 # [1, w-1]
    snapshot = target.snapshot(state.cache)
    logits, feats = target.forward(mx.concatenate([anchor, drafts], axis=1),
                                   state.cache)                         # [1, w, V], [1, w, F]
    if sampling.greedy:
        a, bonus = greedy_accept(drafts[0], mx.argmax(logits[0], axis=-1).astype(mx.uint32))
    else:
        q = proposal.dense_q(logits.shape[-1])[0]                               # [w-1, V]
        a, bonus = rejection_accept(drafts[0], sampling.probs(logits[0]), q, accept_key)
    mx.eval(a, bonus, drafts)
    a = a.item()
    snapshot.rollback(a + 1, choice.width)
    return Step(drafts[0, :a].tolist(), bonus, feats)


def _commit(state: DecodeState, anchor: int, step: Step, keep: int | None,
            stop_ids: set[int]) -> list[int]:
    """The anchor and the accepted drafts join the state's rows (features: rows 0..a) -> the
    tokens the step adds: the drafts and the bonus, cut after a stop token."""
    new = step.accepted + [step.bonus.item()]
    state.tokens.extend([anchor] + step.accepted)
    rows = len(step.accepted) + 1
    state.add_features(None if step.feats is None else step.feats[:, :rows], keep)
    stop_at = next((i for i, t in enumerate(new) if t in stop_ids), None)
    return new if stop_at is None else new[: stop_at + 1]


def generate_tokens(target: Target, drafter: Drafter | None, prompt: list[int], *,
                    max_tokens: int, sampling: Sampling, policy, stop_ids: set[int],
                    lookup: LookupConfig | None = None, seed: int | None = None,
                    prefill_step_size: int = 2048, stats: GenerationStats | None = None,
                    state: DecodeState | None = None,
                    progress: Callable[[int, int], object] | None = None
                    ) -> Iterator[list[int]]:
    """Yield the tokens committed by prefill, then by each cycle, until a stop token (included)
    or `max_tokens`. Greedy output equals the target's own greedy decoding token for token.

    policy: `adaptive.FixedWidth` or `AdaptiveWidth`, asked each cycle for a source and width.
    lookup: drafts from the context too (None: the drafter only). state: the caches of an
    earlier generation to reuse for the prompt's common prefix; advanced in place. progress:
    `prefill`'s, for long prompts."""
    stats = stats if stats is not None else GenerationStats()
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    stats.prompt_tokens = len(prompt)
    if max_tokens < 1:
        return
    state = _reuse(state, prompt, target, drafter)
    stats.cached_tokens = len(state.tokens)
    if drafter is not None or lookup is not None:
        target.check_rollback(state.cache)
    key = mx.random.key(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
    keep = drafter.context_window if drafter is not None else None

    tic = time.perf_counter()
    logits = prefill(target, state, prompt[len(state.tokens):], prefill_step_size, keep,
                     progress)
    key, k = mx.random.split(key)
    anchor = sampling.sample(logits, k).reshape(1, 1).astype(mx.uint32)
    tokens = anchor.reshape(-1).tolist()                      # the generated tokens
    index = LookupIndex(lookup, prompt + tokens) if lookup is not None else None
    shadow = Shadow(policy, LOOKUP)        # lookup proposals no cycle verified, scored anyway
    stats.prefill_s, stats.generated_tokens = time.perf_counter() - tic, 1
    tic = time.perf_counter()
    yield list(tokens)

    ahead = None       # a plain step already launched on the anchor: (feats, token)
    clock = PlainClock()
    try:
        while len(tokens) < max_tokens and tokens[-1] not in stop_ids:
            cycle_tic = time.perf_counter()
            room = max_tokens - len(tokens)
            context = len(state.tokens)           # the keys every verified row reads
            choice = _choose(policy, drafter, index, lookup, room, context, ahead is not None)
            # launched last step: this cycle is that plain step
            source, width = (PLAIN, 1) if ahead is not None else (choice.source, choice.width)
            if source != LOOKUP:
                shadow.offer(choice.guess, choice.match, context)
            key, k_draft, k_accept = mx.random.split(key, 3)
            if source == PLAIN:
                # launch the next plain step too, unless the next cycle may draft (the policy
                # wanted to here, and it is worth the chain's restart)
                launch = room > 1 and policy.launch_next(
                    (choice.source, choice.width), choice.available, choice.match, context + 1)
                was_launched = ahead is not None
                step, ahead = _plain_step(target, state, anchor, ahead, launch, sampling,
                                          k_accept, k_draft)
            else:
                step = _speculate(target, drafter, state, anchor, choice, sampling, k_draft,
                                  k_accept)
            new = _commit(state, tokens[-1], step, keep, stop_ids)
            a = len(step.accepted)
            stats.steps.append(Cycle(source, width, a))
            seconds = time.perf_counter() - cycle_tic
            if source == PLAIN:
                seconds = clock.plain(seconds, was_launched, ahead is not None)
                if not clock.long(ahead is not None):
                    seconds = None               # a short chain's steps teach no price
            policy.update(source, width, a, seconds, choice.match, context)
            tokens.extend(new)
            if index is not None:
                index.extend(new)
                shadow.follow(source, width, a, choice.guess, choice.match, context)
                shadow.commit(new)
            stats.generated_tokens, stats.decode_s = len(tokens), time.perf_counter() - tic
            anchor = step.bonus.reshape(1, 1).astype(mx.uint32)
            yield new
            if len(tokens) // 256 != (len(tokens) - len(new)) // 256:
                mx.clear_cache()
    finally:           # a launched step's row is in the cache: the state must say so
        if ahead is not None:
            state.tokens.append(tokens[-1])
            state.add_features(ahead[0], keep)
