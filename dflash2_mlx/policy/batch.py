"""The batch-aware width policy: a sequence's choice in a batched step, priced for the whole
step (`BatchAwareWidth`), and the batched step's correction keys (`step_keys`, `step_ratio`).
Why each rule: docs/batching.md and docs/decisions.md ("The width policy's rules")."""

from __future__ import annotations

import functools
import math

from typing import NamedTuple

from ..decode.stats import DRAFTER, PLAIN
from .adaptive import PLAIN_OUTLOOK, FixedWidth
from .costs import Correction, context_bucket, drafter_pass, pass_seconds, probe_steps
from .fitted import FIT

BATCH = "batch"                 # the batch governor's key (`costs.Governor`)


class Want(NamedTuple):
    """What a sequence's policy chose for a step, run or not: what the batch-aware policies
    of the sequences after it weigh."""

    width: int = 1
    tokens: float = 1.0            # expected tokens committed
    draft_s: float = 0.0           # its drafter pass alone, by the calibration


class BatchAwareWidth:
    """A sequence's policy in a batch: its `AdaptiveWidth` (`inner`: estimates, updates,
    probes), its choice priced by the whole step's tokens per second. A step verifies B x T
    rows (T: the widest block), so whoever widens it pays for every row it pads. Given the
    planned tokens E_p and draft seconds D_p of those before it (`set_batch`), and those after
    it expected to do what their `outlook` said (F_e(T), F_d(T)), width w is worth
        (E_p + E(w) + F_e(T)) / step_cost(n, T, S, pass(D_p, d(w), F_d(T))),  T = max(W, w),
    S the batch cache's slots, pass the step's ONE drafter pass (`costs.drafter_pass`). Alone,
    it chooses as `inner`. shared: the steps' `Correction`, one for the whole batch."""

    def __init__(self, inner, shared: Correction | None = None):
        self.inner = inner
        self.shared = shared if shared is not None else Correction(decay=FIT.batch_decay)
        self.planned: list[tuple[int, float, float]] = []
        self.after = OutlookAfter()                    # the outlooks of those planning after it
        self.slots = None
        self.last = (1.0, 0.0)                  # `WidthPolicy`
        self.outlook: tuple[tuple[float, float], ...] | None = None
        self.rate: float | None = None      # the step's tokens/s its latest batched choice saw
        self.plain_run = 0                  # batched plain choices since drafting or a probe
        self.probing = self.probe_again = False
        self.plain_next = False             # its latest batched choice: plain next step too

    def set_batch(self, planned: list[tuple[int, float, float]], after,
                  slots: int | None = None) -> None:
        """planned: (width, expected tokens, draft seconds) of those planned before it this
        step; after: the policies planning after it (a list, their `OutlookAfter`, or how
        many: each then expected to choose as it does); slots: the keys each row reads."""
        self.planned, self.slots = list(planned), slots
        if isinstance(after, int):
            after = OutlookAfter(after, after)
        self.after = after if isinstance(after, OutlookAfter) else outlooks_after(after)[0]

    def step_cost(self, n: int, T: int, context: int | None = None,
                  drafts: float = 0.0) -> float:
        """Seconds of a batched step of n sequences x T rows over `context` slots after a
        drafter pass of `drafts` calibrated seconds: the verify and the pass alike corrected
        by `step_ratio`."""
        return (self.inner.cost.verify(n * T, context) + drafts) * step_ratio(
            self.shared, n, T, context)

    def observe(self, n: int, T: int, context: int | None, seconds: float,
                drafts: float = 0.0, tokens: int | None = None) -> None:
        """A batched step (as `step_cost`) took `seconds`, at most twice the price the policies
        saw counting; tokens: what it committed (for the governor)."""
        self.shared.observe(step_keys(n, T, context), seconds,
                            self.inner.cost.verify(n * T, context) + drafts,
                            step_ratio(self.shared, n, T, context))
        if tokens is not None:
            self._govern(n, T, context, seconds, tokens)

    def _govern(self, n: int, T: int, context: int | None, seconds: float,
                tokens: int) -> None:
        """The batch's governor: each drafting step of two or more sequences with no probe in
        it (`update` marks those, so it is sent a step late) against their plain step's timed
        price."""
        gov = self.shared.governor
        if gov.pending is not None:
            made, took, m, slots, probe = gov.pending
            if not probe:
                r = self.shared.trusted(step_keys(m, 1, slots))
                plain = self.inner.cost.verify(m, slots) * (r or 1.0)
                gov.drafted(BATCH, made, took, None if r is None else plain / m, plain,
                            (m.bit_length(), context_bucket(slots)))
            gov.pending = None
        if T == 1:
            gov.plain_step()
        elif n > 1:
            gov.pending = [tokens, seconds, n, context, False]

    def _options(self, available: dict, match_n: int, context: int | None):
        """(source, w, E(w), draft seconds) of every choice on offer, plain first."""
        inner = self.inner
        yield PLAIN, 1, 1.0, 0.0
        for source, most in available.items():
            e, p = 1.0, 1.0
            for w, alpha in zip(range(2, min(most, inner.widths[source]) + 1),
                                inner.alphas(source, match_n, context)):
                p *= alpha
                e += p
                yield source, w, e, inner.cost.draft(w, context) if source == DRAFTER else 0.0

    def choose(self, available: dict | None = None, match_n: int = 0,
               context: int | None = None, launched: bool = False) -> tuple[str, int]:
        """As `AdaptiveWidth.choose`, priced for the step; `context`: this sequence's tokens."""
        available = dict(self.inner.widths) if available is None else available
        opts = list(self._options(available, match_n, context))
        options = {(s, w): (e, d) for s, w, e, d in opts}
        if not self.planned and not self.after.count:
            best = self.inner.choose(available, match_n, context, launched)
            self.outlook = self.rate = None
            self.last = options.get(best, (1.0, 0.0))
            return best
        n = len(self.planned) + self.after.count + 1
        if self.shared.governor.held(BATCH):        # drafting delivered less than plain
            self.outlook, self.rate, self.last = PLAIN_OUTLOOK, None, (1.0, 0.0)
            self.probing, self.plain_next = False, True
            return PLAIN, 1
        widest = max((w for w, _, _ in self.planned), default=1)
        tokens = sum(e for _, e, _ in self.planned)
        draft = sum(d for _, _, d in self.planned)
        top = max((d for _, _, d in self.planned), default=0.0)
        slots = self.slots if self.slots is not None else context
        rows = {T: (self.inner.cost.verify(n * T, slots), step_ratio(self.shared, n, T, slots))
                for T in {max(widest, w) for _, w, _, _ in opts}}
        # its own outlook, for those after it without one (at the batch's rate: its latest,
        # or the step's with the rest plain)
        v, r = rows[widest]
        batch_rate = self.rate or (tokens + n - len(self.planned)) / (
            r * (v + pass_seconds(draft, top)))
        mine = _best_within(opts, batch_rate * r)
        others = {T: self.after.within(T, mine) for T in rows}

        def rate(choice):
            e, d = options[choice]
            T = max(widest, choice[1])
            v, r = rows[T]
            oe, od, otop = others[T]
            return (tokens + e + oe) / (r * (v + pass_seconds(draft + d + od, max(top, d, otop))))
        rates = {c: rate(c) for c in options}
        best = max(rates, key=rates.get)
        self.rate = rates[best]
        self.outlook = _best_within(opts, self.rate * rows[max(widest, best[1])][1])
        # probe as AdaptiveWidth does, spaced by what a batched probe costs
        near = any(r >= self.inner.far * rates[best] for c, r in rates.items() if c[1] > 1)
        self.plain_run = self.plain_run + 1 if best[1] == 1 else 0
        self.probing = False
        gap = (self._probe_gap(n, slots, context, near)
               if best[1] == 1 and (DRAFTER, 2) in options else math.inf)
        if not launched and (self.probe_again and near and gap < math.inf
                             or self.plain_run >= gap):
            self.plain_run, best, self.probing, self.probe_again = 0, (DRAFTER, 2), True, False
        elif best[1] == 1 and not launched and len(rates) > 1 and self._reference(
                slots, max(r for c, r in rates.items() if c[1] > 1) / rates[best]):
            best = max((c for c in rates if c[1] > 1), key=rates.get)
            self.plain_run, self.probing = 0, True
        # plain again next step unless the batch changes: no probe due or asked for then
        self.plain_next = best[1] == 1 and not (self.probe_again and near) \
            and self.plain_run + 1 < gap
        self.last = options[best]
        return best

    def _reference(self, slots: int | None, worth: float) -> bool:
        """Whether to draft once at this context size, where no batched drafting step has been
        timed and drafting's best is priced at `MachineFit.reference_worth` of plain's rate or more
        (`worth`): plain steps' ratio alone can misprice the drafter's pass for good."""
        bucket = context_bucket(slots)
        gov, key = self.shared.governor, ("draft", bucket)
        if worth < FIT.reference_worth or key in gov.referenced or any(
                k[0] == bucket and k[1] == 0 for k in self.shared.table):
            return False
        gov.referenced.add(key)
        return True

    def _probe_gap(self, n: int, slots: int | None, context: int | None, near: bool) -> float:
        """Plain steps between this sequence's probes: as alone (`costs.probe_steps` over the
        budget), a probe's extra seconds being its n more rows and drafter pass, times n (the
        batch's probes together stay within the budget)."""
        plain = self.step_cost(n, 1, slots)
        extra = self.step_cost(n, 2, slots, self.inner.cost.draft(2, context)) - plain
        return n * probe_steps(extra / plain, near) / self.inner.budget[near]

    def next_plain(self, available: dict, context: int | None = None) -> bool:
        """Alone as `inner` says; in a batch when its latest choice was plain and no probe is
        due or asked for at the next step."""
        alone = not self.planned and not self.after.count
        return self.inner.next_plain(available, context) if alone else self.plain_next

    def launch_next(self, choice: tuple[str, int], available: dict, match_n: int = 0,
                    context: int | None = None) -> bool:
        """Alone as `inner` says; in a batch when this step's choice was plain and
        `next_plain`."""
        if not self.planned and not self.after.count:
            return self.inner.launch_next(choice, available, match_n, context)
        return choice[1] == 1 and self.plain_next

    def update(self, source: str, width: int, accepted: int, seconds: float | None = None,
               match_n: int = 0, context: int | None = None, first: int = 1) -> None:
        """`WidthPolicy.update`: a probe's outcome, then as `inner`."""
        pending = self.shared.governor.pending
        if pending is not None and self.probing and source == DRAFTER:
            pending[4] = True                      # a probe's step keeps to the probe budget
        if self.probing and source == DRAFTER:
            self.probe_again, self.probing = accepted > 0, False
        self.inner.update(source, width, accepted, seconds, match_n, context, first)


def plain_is_better(wants: list[tuple[object, tuple[int, float, float]]],
                slots: int | None = None) -> bool:
    """Whether every sequence decoding plainly is worth more tokens per second than what their
    policies want (policy, (width, expected tokens, draft seconds)), by the batch's prices
    (each chose expecting the others to draft). Never against a probe or a policy of another
    kind."""
    wanting = [q for q, (w, _, _) in wants if w > 1]
    if len(wants) < 2 or not wanting or not all(
            isinstance(q, BatchAwareWidth) and not q.probing for q in wanting):
        return False
    policy, n = wanting[0], len(wants)
    plain = policy.step_cost(n, 1, slots)
    step = policy.step_cost(n, max(w for _, (w, _, _) in wants), slots,
                            drafter_pass(d for _, (_, _, d) in wants))
    return sum(e for _, (_, e, _) in wants) / step < n / plain


def _outlook(policy) -> tuple | None:
    """What a policy planning later in the step is expected to choose within each widest
    block (None: unknown)."""
    if isinstance(policy, BatchAwareWidth):
        return policy.outlook
    if isinstance(policy, FixedWidth) and policy.width == 1:
        return PLAIN_OUTLOOK
    return None


def _best_within(options: list, rate: float) -> tuple[tuple[float, float], ...]:
    """For T = 1 .. the widest option, the (E, d) of the option of width <= T that adds the
    most to a step running at `rate` tokens/s (E - rate d: its rows are paid for)."""
    by_width: list[tuple[float, float] | None] = [None] * max(w for _, w, _, _ in options)
    for _, w, e, d in options:
        x = by_width[w - 1]
        if x is None or e - rate * d > x[0] - rate * x[1]:
            by_width[w - 1] = (e, d)
    out, cur = [], PLAIN_OUTLOOK[0]
    for x in by_width:
        if x is not None and x[0] - rate * x[1] > cur[0] - rate * cur[1]:
            cur = x
        out.append(cur)
    return tuple(out)


class OutlookAfter:
    """What the policies planning after a sequence are expected to add to a step: count;
    unknown, those without an outlook (expected to choose as the sequence); sums[T - 1], for a
    widest block T = 1 .. W, the (expected tokens, draft seconds, dearest draft) of the rest."""

    def __init__(self, count: int = 0, unknown: int = 0, sums: tuple = ()):
        self.count, self.unknown, self.sums = count, unknown, sums

    def within(self, T: int, mine: tuple) -> tuple[float, float, float]:
        """(tokens, draft seconds, dearest draft) of them within T; mine: the sequence's own
        outlook, for the unknown."""
        e, d, top = self.sums[min(T, len(self.sums)) - 1] if self.sums else (0.0, 0.0, 0.0)
        if self.unknown:
            me, md = mine[min(T, len(mine)) - 1]
            e, d, top = e + self.unknown * me, d + self.unknown * md, max(top, md)
        return e, d, top


def outlooks_after(policies: list) -> list[OutlookAfter]:
    """[i]: the `OutlookAfter` of policies[i:], for i = 0 .. len(policies): suffix sums of their
    outlooks, O(B W) once per step."""
    outlooks = [_outlook(p) for p in policies]
    W = max((len(o) for o in outlooks if o), default=1)
    zeros = ((0.0, 0.0, 0.0),) * W
    out = [OutlookAfter()]
    for o in reversed(outlooks):
        prev = out[-1]
        if o is None:
            out.append(OutlookAfter(prev.count + 1, prev.unknown + 1, prev.sums))
            continue
        o = o + (o[-1],) * (W - len(o))
        out.append(OutlookAfter(prev.count + 1, prev.unknown, tuple(
            (pe + e, pd + d, max(pt, d)) for (pe, pd, pt), (e, d) in zip(prev.sums or zeros, o))))
    return out[::-1]


def step_keys(n: int, T: int, context: int | None) -> tuple:
    """A batched step's correction keys, most specific first: its octave of sequences (1,
    2-3, 4-7, ...) with its octave of width T, then (T > 1) with every width above 1, at its
    context size, then at any. Plain (T = 1) and drafting steps never share a key."""
    return _keys(int(n).bit_length(), int(T).bit_length(), context_bucket(context))


@functools.lru_cache(maxsize=None)
def _keys(n_octave: int, t_octave: int, bucket: int) -> tuple:
    widths = (t_octave,) if t_octave == 1 else (t_octave, 0)      # 0: any width above 1
    return tuple((b, t, n_octave) for b in (bucket, None) for t in widths)


def step_ratio(shared: Correction, n: int, T: int, context: int | None) -> float:
    """The correction of a batched step of this shape: its keys' (`step_keys`) once one is
    trusted; before, a seed from its timed neighbours (`_prior_ratio`) with its own first timings
    blended in (`Correction.blend`)."""
    shape = (int(n).bit_length(), int(T).bit_length(), context_bucket(context))
    if shape not in shared.memo:          # every sequence of a step asks, for every width
        shared.memo[shape] = _shape_ratio(shared, *shape)
    return shared.memo[shape]


def _shape_ratio(shared: Correction, no: int, to: int, bucket: int) -> float:
    own = _keys(no, to, bucket)
    r = shared.trusted(own)
    return r if r is not None else shared.blend(own, _prior_ratio(shared, no, to, bucket))


def _prior_ratio(shared: Correction, no: int, to: int, bucket: int) -> float:
    """An untrusted shape's prior: the nearest trusted octave of sequences' ratio (plain with
    plain, drafting with drafting), a drafting one scaled by the two octaves' plain ratios
    and never below its own octave's plain ratio."""
    plain = 1.0 if to == 1 else _shape_ratio(shared, no, 1, bucket)
    for o in _neighbours(no):
        r = shared.trusted(_keys(o, to, bucket))
        if r is None:
            continue
        if to == 1:
            return r
        there = shared.trusted(_keys(o, 1, bucket))
        return max(r * plain / there if there else r, plain)
    return plain


@functools.lru_cache(maxsize=None)
def _neighbours(n_octave: int) -> tuple:
    """The other octaves of sequences, nearest first (the larger of two as near)."""
    return tuple(sorted((o for o in range(1, 17) if o != n_octave),
                        key=lambda o: (abs(o - n_octave), -o)))
