"""One sequence's width policies: which source drafts each cycle and how many rows to verify.

A cycle drafts from the drafter, from a lookup in the context, or not at all (a plain step).
`AdaptiveWidth` picks the (source, width) with the most expected tokens per second: E(w) = 1 +
sum_{k<w} prod_{j<=k} alpha_j tokens (alpha_k = P(draft k accepted | drafts < k accepted), from
decayed counts) over the cycle's `CostModel` seconds, corrected by the cycles timed. Why each
rule: docs/decisions.md ("The width policy's rules").
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace

from ..decode.stats import DRAFTER, LOOKUP, PLAIN, PositionCounts
from .costs import SPREAD, CostModel, Correction, context_bucket, monotone, probe_steps
from .fitted import FIT

MATCH_BUCKETS = (1, 2, 3, 4, 8)     # lookup suffix lengths tracked apart: n, or the largest <= n
PLAIN_OUTLOOK = ((1.0, 0.0),)       # plain decoding's `BatchAwareWidth.outlook`
# from this context bucket (1024 tokens) estimates are kept per context size, and offer
# positions up to `MachineFit.untried_reach` times the deepest tried one (`prior_at`,
# `alphas`): a wide cycle that fails costs plain steps
LONG_BUCKET = 2


class FixedWidth:
    """Every cycle verifies `width` rows (fewer where a source cannot draft that many),
    drafted by the lookup when the context has a match, else by the drafter."""

    last = (1.0, 0.0)           # `WidthPolicy`: what a batch assumes of a policy that says none

    def __init__(self, width: int):
        self.width = width

    def choose(self, available: dict[str, int], match_n: int = 0,
               context: int | None = None, launched: bool = False) -> tuple[str, int]:
        for source in (LOOKUP, DRAFTER):
            if self.width > 1 and available.get(source, 1) > 1:
                return source, min(self.width, available[source])
        return PLAIN, 1

    def next_plain(self, available: dict[str, int], context: int | None = None) -> bool:
        return self.width == 1

    def launch_next(self, choice: tuple[str, int], available: dict[str, int],
                    match_n: int = 0, context: int | None = None) -> bool:
        return self.next_plain(available, context)

    def update(self, source: str, width: int, accepted: int, seconds: float | None = None,
               match_n: int = 0, context: int | None = None, first: int = 1) -> None:
        pass


class AdaptiveWidth:
    """Chooses each cycle's source and width (`WidthPolicy`).

    widths: the widest block of each source (default: the drafter's at the calibrated width).
    prior: alpha_1 before any evidence, worth `strength` tries; decay: the weight of older
    tries (0.95: ~20 tries of memory); far, budget: the probes' budget (`_probe_gap`); store:
    writes corrected prices back to the stored calibration; cut: the planner narrows its
    drafted blocks to what their predicted acceptance pays for (`policy.cut`)."""

    last = (1.0, 0.0)           # `WidthPolicy`: alone it tells a batch nothing of its choices

    def __init__(self, cost: CostModel, widths: dict[str, int] | None = None,
                 prior: float = FIT.prior, strength: float = FIT.prior_strength,
                 decay: float = FIT.decay, far: float = FIT.far,
                 budget: tuple[float, float] = FIT.probe_budget,
                 store: Callable[[CostModel], None] | None = None, cut: bool = True):
        self.cost, self.decay, self.far, self.budget = cost, decay, far, budget
        self.cut = cut
        self.store = store
        self.widths = widths or {DRAFTER: cost.max_width}
        self.counts: dict[str, PositionCounts] = {}        # shared by its `for_sequence`s
        self.prior_hits, self.prior_tries = prior * strength, strength
        self.narrow: dict[tuple[str, int], float] = {}     # (source, bucket) -> alpha
        self.plain_run = 0                  # plain cycles since the policy last drafted
        # the latest cycle was a probe; an accepted one asks for another at once
        self.probing = self.probe_again = False
        self.correction = Correction(decay)
        self.correction.governor.budget = budget[0]
        self.own: dict[str, PositionCounts] = {}    # this sequence's lookup counts (`_evidence`)

    def for_sequence(self) -> "AdaptiveWidth":
        """A policy for one more sequence: the cost model, acceptance counts and corrections
        shared; its own probe state and lookup counts (`own`)."""
        other = copy.copy(self)                 # the containers are shared, not copied
        other.plain_run, other.probing, other.probe_again = 0, False, False
        other.own = {}
        return other

    def cycle_cost(self, width: int, source: str = DRAFTER, context: int | None = None) -> float:
        """Expected seconds of a cycle: the cost model times the correction of `price_keys`."""
        source = PLAIN if width == 1 else source
        return self.cost.cycle(width, source, context) * self.correction.ratio(
            price_keys(source, width, context))

    def counts_for(self, source: str, match_n: int = 0,
                   context: int | None = None) -> PositionCounts:
        """A source's shared counts: per context size from `LONG_BUCKET`; the lookup's per
        suffix length (`MATCH_BUCKETS`) and context size at every length."""
        return self._counts(self.counts, source, match_n, context)

    def _counts(self, table: dict, source: str, match_n: int,
                context: int | None) -> PositionCounts:
        bucket = context_bucket(context)
        if source == LOOKUP:
            key = (f"{LOOKUP}:{max([b for b in MATCH_BUCKETS if b <= match_n] or [0])}"
                   f":{bucket}")
        else:
            key = source if bucket < LONG_BUCKET else f"{source}:{bucket}"
        if key not in table:
            table[key] = PositionCounts(self.widths[source] - 1, self.decay)
        return table[key]

    def alphas(self, source: str = DRAFTER, match_n: int = 0,
               context: int | None = None) -> list[float]:
        """Estimated alpha_k of a source: position 1's prior is `prior_at`, each later one's the
        estimate before it (a rarely reached position keeps no optimistic prior). From
        `LONG_BUCKET`, positions up to `MachineFit.untried_reach` times the deepest one with evidence
        (alpha_1 only where none has any: 2 rows): an untried position only copies the
        estimate before it."""
        c = self.counts_for(source, match_n, context)
        out, prior, tried = [], self.prior_at(source, context), 0
        for k, (h, t) in enumerate(self._evidence(c, source, match_n, context), 1):
            prior = (h + prior * self.prior_tries) / (t + self.prior_tries)
            out.append(prior)
            tried = k if t > 0 else tried
        if context_bucket(context) < LONG_BUCKET:
            return out
        return out[:max(FIT.untried_reach * tried, 1)]

    def _evidence(self, c: PositionCounts, source: str, match_n: int, context: int | None):
        """(hits, tries) per position: the shared counts `c`; the lookup's from `LONG_BUCKET`
        this sequence's own plus the others' weighing `MachineFit.carry` tries at most."""
        if source != LOOKUP or context_bucket(context) < LONG_BUCKET:
            return zip(c.hits, c.tries)
        own = self._counts(self.own, source, match_n, context)
        out = []
        for h, t, oh, ot in zip(c.hits, c.tries, own.hits, own.tries):
            others = max(t - ot, 0.0)
            scale = min(1.0, FIT.carry / others) if others > 1e-9 else 0.0
            out.append((oh + scale * max(h - oh, 0.0), ot + scale * others))
        return out

    def prior_at(self, source: str, context: int | None) -> float:
        """alpha_1 before any evidence: `prior`; the lookup's from `LONG_BUCKET` at most the
        largest alpha at which its best cycle is 2 rows or plain, at the bucket's shortest
        context (the bare cost model). The drafter keeps `prior`."""
        prior, bucket = self.prior_hits / self.prior_tries, context_bucket(context)
        if bucket < LONG_BUCKET or source != LOOKUP:
            return prior
        key = (source, bucket)
        if key not in self.narrow:
            n = 1 << (bucket + 8)                # the bucket's shortest context
            costs = [self.cost.cycle(w, source if w > 1 else PLAIN, n)
                     for w in range(1, self.widths[source] + 1)]

            def narrow(a: float) -> bool:        # E(w) = 1 + a + ... + a^(w-1) tokens
                rates = [sum(a**k for k in range(w)) / c for w, c in enumerate(costs, 1)]
                return rates.index(max(rates)) < 2

            lo, hi = 0.0, 1.0
            for _ in range(20):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if narrow(mid) else (lo, mid)
            self.narrow[key] = lo
        return min(prior, self.narrow[key])

    def choose(self, available: dict[str, int] | None = None, match_n: int = 0,
               context: int | None = None, launched: bool = False) -> tuple[str, int]:
        """(source, width) with the most expected tokens per second (available: default every
        source at its widest), or a drafter probe when due. launched: a plain step launched
        last cycle, whatever is chosen: a probe due now waits for the next cycle."""
        rate = self._rates(dict(self.widths) if available is None else available, match_n,
                           context)
        best = max(rate, key=rate.get)
        if len(rate) == 1:          # nothing on offer (the last token of a generation)
            return best
        if best[1] > 1:
            self.plain_run = 0
            return best
        if (DRAFTER, 2) in rate and not launched and (
                self.plain_run >= self._probe_gap(rate, context) or self.probe_again):
            self.plain_run, self.probe_again = 0, False   # the lookup needs none: see LookupShadow
            self.probing = True
            return DRAFTER, 2
        self.plain_run += 1
        return best

    def launch_next(self, choice: tuple[str, int], available: dict[str, int],
                    match_n: int = 0, context: int | None = None) -> bool:
        """Whether this plain step launches the next one (which is then plain whatever it
        chooses). choice: this cycle's wish; a draft breaks the chain only when unproven or
        worth the restart (`CostModel.relaunch`): the seconds its best cycle saves over plain
        steps for a run of them, times the chance it comes (a lookup's: alpha_1, its match
        then one token longer). Else as `next_plain`."""
        source, width = choice
        if width > 1:
            c = self.counts_for(source, match_n, context)
            if not next(iter(self._evidence(c, source, match_n, context)), (0.0, 0.0))[1]:
                return False
            chance, longer = ((self.alphas(source, match_n, context)[0], match_n + 1)
                              if source == LOOKUP else (1.0, match_n))
            plain, worth = self.cycle_cost(1, PLAIN, context), 0.0
            tokens, p = 1.0, 1.0                 # E(w) and P(all w - 1 drafts pass)
            for w, alpha in zip(range(2, min(available[source], self.widths[source]) + 1),
                                self.alphas(source, longer, context)):
                p *= alpha
                tokens += p
                saves = tokens * plain - self.cycle_cost(w, source, context)
                worth = max(worth, saves / (1.0 - min(p, 0.95)))   # a run: while all pass
            if chance * worth > self.cost.relaunch:
                return False
        return self.next_plain(available, context)

    def next_plain(self, available: dict[str, int], context: int | None = None) -> bool:
        """Whether the next cycle will be plain unless the lookup finds a match: plain is the
        best choice without it, and no probe is due."""
        rate = self._rates({s: w for s, w in available.items() if s != LOOKUP}, 0, context)
        best = max(rate, key=rate.get)
        return best[1] == 1 and ((DRAFTER, 2) not in rate or not self.probe_again
                                 and self.plain_run < self._probe_gap(rate, context))

    def _probe_gap(self, rate: dict, context: int | None) -> float:
        """Plain cycles between probes, so that what probes cost over plain steps
        (`costs.probe_steps`) stays under `budget[0]` of the time while drafting is far from
        paying (best rate < `far` x plain's), `budget[1]` while it nearly pays."""
        plain = self.cycle_cost(1, PLAIN, context)
        near = max(r for c, r in rate.items() if c[1] > 1) >= self.far * rate[(PLAIN, 1)]
        extra = (self.cycle_cost(2, DRAFTER, context) - plain) / plain
        return probe_steps(extra, near) / self.budget[near]

    def _rates(self, available: dict[str, int], match_n: int,
               context: int | None) -> dict[tuple[str, int], float]:
        """Expected tokens per second of each (source, width) on offer, plain included."""
        rate = {(PLAIN, 1): 1.0 / self.cycle_cost(1, PLAIN, context)}
        for source, most in available.items():
            if self.correction.governor.held(source):
                continue
            tokens, p = 1.0, 1.0               # E(w), accumulated over the widths in turn
            for w, alpha in zip(range(2, min(most, self.widths[source]) + 1),
                                self.alphas(source, match_n, context)):
                p *= alpha
                tokens += p
                rate[(source, w)] = tokens / self.cycle_cost(w, source, context)
        return rate

    def update(self, source: str, width: int, accepted: int, seconds: float | None = None,
               match_n: int = 0, context: int | None = None, first: int = 1) -> None:
        """After a cycle (`WidthPolicy.update`): counts, probe outcome, correction, governor."""
        if width > 1:
            self.counts_for(source, match_n, context).update(width, accepted, first)
            if source == LOOKUP and context_bucket(context) >= LONG_BUCKET:
                self._counts(self.own, source, match_n, context).update(width, accepted, first)
        probe = self.probing and source == DRAFTER
        if probe:                                     # (shadows score the lookup only)
            self.probe_again, self.probing = accepted > 0, False
        if seconds is not None:
            source = PLAIN if width == 1 else source
            self.correction.observe(cycle_keys(source, width, context), seconds,
                                    self.cost.cycle(width, source, context))
        if width == 1:
            self.correction.governor.plain_step()
        elif seconds is not None and not probe:       # probes keep to their own budget
            self._govern(source, accepted + 1, seconds, context)

    def _govern(self, source: str, tokens: int, seconds: float, context: int | None) -> None:
        """Tell the governor what a drafting cycle delivered against plain decoding's timed
        price; when it trips, store the `corrected` prices for the next process."""
        r = self.correction.trusted(price_keys(PLAIN, 1, context))
        plain_step = self.cycle_cost(1, PLAIN, context)
        tripped = self.correction.governor.drafted(
            source, tokens, seconds, None if r is None else plain_step, plain_step,
            context_bucket(context))
        if tripped and self.store is not None:
            fixed = self.corrected()
            if fixed is not None:
                self.store(fixed)

    def corrected(self) -> CostModel | None:
        """The cost model with each width's prices scaled by its timed ratio over plain steps'
        at the same context size (load that slows every forward cancels out), at the shortest
        size where both were timed; None where none is off by more than `SPREAD`. Drafter
        cycles scale pass and verify alike unless lookup cycles timed the verify."""
        c, cost = self.correction, self.cost
        verify, draft = list(cost.verify_table), list(cost.draft_table)
        done_v, done_d, changed = set(), set(), False
        for b in range(16):
            plain = c.trusted([(PLAIN, 1, b)])
            if plain is None:
                continue
            for w in range(2, cost.max_width + 1):
                lookup, drafter = c.trusted([(LOOKUP, w, b)]), c.trusted([(DRAFTER, w, b)])
                if lookup is not None and w not in done_v:
                    done_v.add(w)
                    verify[w - 1] = cost.verify_table[w - 1] * lookup / plain
                    changed |= abs(lookup / plain - 1) > SPREAD
                if drafter is not None and w not in done_d and w <= len(draft):
                    done_d.add(w)
                    was = cost.draft_table[w - 1] + cost.verify_table[w - 1]
                    if w not in done_v:
                        done_v.add(w)
                        verify[w - 1] = cost.verify_table[w - 1] * drafter / plain
                    draft[w - 1] = max(was * drafter / plain - verify[w - 1], 0.0)
                    changed |= abs(drafter / plain - 1) > SPREAD
        if not changed:
            return None
        return replace(cost, verify_table=tuple(monotone(verify)),
                       draft_table=tuple([0.0] + monotone(draft[1:])))


def cycle_keys(source: str, width: int, context: int | None) -> tuple:
    """The correction keys a cycle teaches, most specific first (the first trusted prices):
    (source, width) at this context size and at any; a drafter's or lookup's own cycles at
    this size and at any (not plain steps: launched ahead they run cheaper than the model);
    every cycle at this size, and at any."""
    bucket = context_bucket(context)
    keys = ((source, width, bucket), (source, width, None))
    if source in (DRAFTER, LOOKUP):
        keys += ((source, bucket), (source, None))
    return keys + (("all", bucket), ("all", None))


def price_keys(source: str, width: int, context: int | None) -> tuple:
    """The keys a cycle is priced by: its `cycle_keys`, a plain step's own two only (it
    teaches the others' keys, and borrows from none)."""
    keys = cycle_keys(source, width, context)
    return keys[:2] if source == PLAIN else keys


class LookupShadow:
    """Learns the lookup's acceptance for free: a proposal no cycle verified is scored against
    the tokens that commit, and the policy told what a cycle would have accepted (`update`
    without seconds). Unbiased when sampling too (a committed token equals a proposed one with
    probability p(token), the point-mass acceptance); a drafter's would be biased low. One
    proposal is followed at a time, as cycles would."""

    def __init__(self, policy, source: str = LOOKUP):
        self.policy, self.source = policy, source
        # (proposal, match_n, context, the first position to count); tokens committed since
        self.open: tuple[list[int], int, int | None, int] | None = None
        self.seen: list[int] = []

    def offer(self, guess, match_n: int = 0, context: int | None = None) -> None:
        """A proposal (token ids) this cycle does not verify; ignored while one is followed."""
        if guess and self.open is None:
            self.open, self.seen = (list(guess), match_n, context, 1), []

    def follow(self, source: str, width: int, accepted: int, guess, match_n: int = 0,
               context: int | None = None) -> None:
        """After a verified cycle, before its commit: a cycle of this source that accepted all
        of a longer proposal's width - 1 drafts has the rest of it followed from position
        `width`; any other cycle, or one while a proposal is followed, is ignored."""
        if (source == self.source and accepted == width - 1 and guess and len(guess) >= width
                and self.open is None):
            self.open, self.seen = (list(guess), match_n, context, width), []

    def commit(self, new: list[int]) -> None:
        if self.open is None:
            return
        guess, match_n, context, first = self.open
        self.seen.extend(new)
        a = next((i for i, (g, t) in enumerate(zip(guess, self.seen)) if g != t), None)
        if a is None and len(self.seen) < len(guess):
            return                                         # all agree so far: keep following
        self.policy.update(self.source, len(guess) + 1, len(guess) if a is None else a,
                           None, match_n, context, first)
        self.open = None

