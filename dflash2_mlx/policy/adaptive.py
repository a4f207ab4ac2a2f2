"""Width policies: which source drafts each cycle and how many rows the target verifies.

A cycle drafts from one source, the DFlash drafter or a lookup in the context
(`lookup.LookupIndex`), or none (width 1: a plain decoding step). `FixedWidth` is the trivial
policy. `AdaptiveWidth` picks each cycle the source and width with the most expected tokens
per second: with per-position acceptance rates alpha_k = P(draft k accepted | drafts < k
accepted) of a source, a cycle of width w commits on average E(w) = 1 + sum_{k<w} prod_{j<=k}
alpha_j tokens and costs C(w, n) = draft(w, n) + verify(w, n) seconds at context length n (a
lookup drafts for free; `costs.CostModel`). Costs are measured once per machine, model pair
and precision, at a few context lengths, and cached, then corrected by the cycles actually
timed (a busy machine, per-cycle bookkeeping the calibration does not see), per context size
(`costs.context_bucket`, `costs.Correction`): a (source, width) timed a few times at this
context size costs the model's figure times what its cycles took over what the model said,
one not yet timed the model's figure times that ratio over all the cycles timed at this size
(or at any). The alphas are running estimates per source (the lookup's per suffix length and
context size, the drafter's per context size from 1k tokens): counts of the recent tries of
each position (older tries decay), so a change of content - code to chat - shows within tens
of cycles. From 1k tokens an estimate without evidence starts where a 2-row cycle is the
widest worth verifying at that context (`prior_at`), not at the short-context prior: a wide
cycle that fails costs several plain steps there, and the lookup's evidence from other
requests counts as one try beside the request's own (`CARRY`). The lookup's proposals that no
cycle verified are scored against the tokens that committed (`Shadow`), so its
estimates stay current for free; the drafter's cannot be, so while the policy decodes plainly
it drafts one token now and then to notice when drafting pays again: probes spaced so that
what they cost over plain steps stays under 1% of the time where drafting is far from paying
(5% where it nearly pays, where probes are worth more), at every context length. A plain step
launches the next one before its token is read (`launch_next`), so a chain of them hides each
step's graph build; a draft wanted on a launched step breaks the chain only when it is worth
the restart. Whatever the prices say, a governor (`costs.Governor`) holds a source plain while
its latest drafting cycles delivered less than plain decoding timed in this process, and the
prices they showed wrong are written back to the stored calibration (`corrected`).
"""

from __future__ import annotations
import copy
from collections.abc import Callable
from dataclasses import replace

from .costs import SPREAD, CostModel, Correction, context_bucket, monotone, probe_steps

DRAFTER, LOOKUP, PLAIN = "drafter", "lookup", "plain"     # the sources of a cycle's drafts
MATCH_BUCKETS = (1, 2, 3, 4, 8)     # lookup suffix lengths tracked apart: n, or the largest <= n
# From this context bucket (`costs.context_bucket`: 1024 tokens) a source's estimates are kept
# per context size and start where 2 rows are the most a cycle should verify (`prior_at`), not
# at `prior`: an unproven 8- or 16-row cycle that fails costs ~3 plain steps at 2k tokens
LONG_BUCKET = 2
# From LONG_BUCKET, the lookup's evidence from other sequences (requests before, the rest of a
# batch) weighs as this many tries at most beside the sequence's own: its acceptance is the
# request's content, and there a failing wide cycle costs several plain steps. A request whose
# lookup failed right after one that copied (an edit after a quoted log at 4k tokens) kept
# verifying wide blocks until ~14 failures had halved the other's decayed tries. Replayed in
# the bench's order of sets, the worst round went from 0.86x to 0.95x plain, the geometric
# mean from 1.090x to 1.096x; a request alone is priced as before (docs/benchmarks.md).
CARRY = 1.0


class PositionCounts:
    """Tries and acceptances of each draft position of one source. Position k (1-based) is
    tried in a cycle of width > k whose drafts 1..k-1 were all accepted; each try weighs the
    older ones by `decay` (1.0: plain counts)."""

    def __init__(self, positions: int, decay: float = 1.0):
        self.decay = decay
        self.hits, self.tries = [0.0] * positions, [0.0] * positions

    def update(self, width: int, accepted: int, first: int = 1) -> None:
        """A cycle of `width` rows accepted `accepted` drafts: positions `first` .. the first
        rejected one (at most width - 1) were tried (those before `first` were counted
        already: a shadow following a verified run)."""
        for k in range(first, min(accepted + 1, width - 1, len(self.tries)) + 1):
            self.tries[k - 1] = self.tries[k - 1] * self.decay + 1
            self.hits[k - 1] = self.hits[k - 1] * self.decay + (k <= accepted)

    def rates(self) -> list[float | None]:
        """hits / tries per position; None for a position never tried."""
        return [h / t if t else None for h, t in zip(self.hits, self.tries)]


class FixedWidth:
    """The trivial policy: every cycle verifies `width` rows (fewer where a source cannot draft
    that many), drafted by the lookup when the context has a match, else by the drafter."""

    def __init__(self, width: int):
        self.width = width

    def choose(self, available: dict[str, int], match_n: int = 0,
               context: int | None = None, launched: bool = False) -> tuple[str, int]:
        """available: the widest block each source can draft this cycle (sources absent: none);
        match_n: the length of the lookup's recurring suffix (0: none); context, launched:
        unused (AdaptiveWidth's)."""
        for source in (LOOKUP, DRAFTER):
            if self.width > 1 and available.get(source, 1) > 1:
                return source, min(self.width, available[source])
        return PLAIN, 1

    def next_plain(self, available: dict[str, int], context: int | None = None) -> bool:
        """Whether the next cycle will surely be a plain step: only at width 1 (a fixed width
        drafts whenever a source can, the lookup included)."""
        return self.width == 1

    def launch_next(self, choice: tuple[str, int], available: dict[str, int],
                    match_n: int = 0, context: int | None = None) -> bool:
        """Whether a plain step launches the next one: as `next_plain`."""
        return self.next_plain(available, context)

    def update(self, source: str, width: int, accepted: int, seconds: float | None = None,
               match_n: int = 0, context: int | None = None, first: int = 1) -> None:
        pass


class AdaptiveWidth:
    """Chooses each cycle's source and width; `update` after each cycle with what was accepted.

    widths: the widest block of each source (default: the drafter's, the calibrated width).
    prior: alpha assumed for position 1 before any evidence (later positions: the estimate of
    the position before), worth `strength` tries; decay: weight of a position's older tries
    each time it is tried (0.95: about 20 tries of memory). The defaults were tuned in
    simulation (tests/test_adaptive.py): within 3% of the best fixed width on steady content,
    ahead of it when content alternates. `context` (choose, update, next_plain): the tokens
    the target's cache holds, which every verified row's attention reads (None: the
    calibration's short context).
    """

    def __init__(self, cost: CostModel, widths: dict[str, int] | None = None,
                 prior: float = 0.8, strength: float = 2.0, decay: float = 0.95,
                 far: float = 0.9, budget: tuple[float, float] = (0.01, 0.05),
                 store: Callable[[CostModel], None] | None = None):
        self.cost, self.decay, self.far, self.budget = cost, decay, far, budget
        # writes prices corrected by the timed cycles back to the stored calibration
        self.store = store
        self.widths = widths or {DRAFTER: cost.max_width}
        # acceptance counts per source; the lookup's per length of its recurring suffix (a
        # long match copies on for many tokens, a two-token one is often a common phrase)
        self.counts: dict[str, PositionCounts] = {}
        self.prior_hits, self.prior_tries = prior * strength, strength
        self.narrow: dict[tuple[str, int], float] = {}     # (source, bucket) -> alpha
        self.plain_run = 0                  # plain cycles since the policy last drafted
        # the last cycle chosen was a probe; one that was accepted asks for another at once
        # (the content may have changed: a few cheap probes confirm it within cycles)
        self.probing = self.probe_again = False
        # the timed cycles against the model (`cycle_keys`), and its governor: a source whose
        # drafting cycles delivered less than plain decoding is held plain for a while
        self.correction = Correction(decay)
        self.correction.governor.budget = budget[0]
        # this sequence's own lookup counts at long context (`_evidence`), fresh per sequence
        self.own: dict[str, PositionCounts] = {}

    def for_sequence(self) -> "AdaptiveWidth":
        """A policy for one more sequence decoding beside this one (a batch): the same cost
        model, acceptance estimates and timed corrections, shared (what any sequence learns,
        every one uses, and the next request starts from it, as one at a time: a fresh
        estimate per request started at the prior and drafted low-acceptance blocks into every
        batch), and its own probe state (plain_run, probing, probe_again) and lookup counts at
        long context (`own`: beside them, the others' evidence weighs `CARRY` tries at most)."""
        other = copy.copy(self)                 # the containers are shared, not copied
        other.plain_run, other.probing, other.probe_again = 0, False, False
        other.own = {}
        return other

    def cycle_cost(self, width: int, source: str = DRAFTER, context: int | None = None) -> float:
        """Expected seconds of a cycle: the cost model at this context times the correction
        of `price_keys`."""
        source = PLAIN if width == 1 else source
        return self.cost.cycle(width, source, context) * self.correction.ratio(
            price_keys(source, width, context))

    def counts_for(self, source: str, match_n: int = 0,
                   context: int | None = None) -> PositionCounts:
        """A source's counts (shared by every sequence), per context size from `LONG_BUCKET`
        (a drafter that pays on a short prompt accepts little after 2k tokens); the lookup's
        per suffix length bucket and per context size at every length (a recurring 3-gram in
        8k tokens of code is a weaker cue than in a short chat)."""
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
        """Estimated alpha_k of a source (the lookup's: for suffix matches of length
        `match_n` at this context size). Position 1 starts from `prior_at`; a later position
        starts from the estimate of the one before it, so positions that are rarely reached
        (drafting goes badly) do not keep an optimistic prior that has no evidence. The
        evidence: `_evidence`."""
        c = self.counts_for(source, match_n, context)
        out, prior = [], self.prior_at(source, context)
        for h, t in self._evidence(c, source, match_n, context):
            prior = (h + prior * self.prior_tries) / (t + self.prior_tries)
            out.append(prior)
        unproven = context_bucket(context) >= LONG_BUCKET and c.tries and not c.tries[0]
        return out[:1] if unproven else out

    def _evidence(self, c: PositionCounts, source: str, match_n: int, context: int | None):
        """(hits, tries) per position: the shared counts `c`; the lookup's from `LONG_BUCKET`
        this sequence's own plus the other sequences' weighing `CARRY` tries at most (its
        acceptance is the request's content: what it copies, from its own context)."""
        if source != LOOKUP or context_bucket(context) < LONG_BUCKET:
            return zip(c.hits, c.tries)
        own = self._counts(self.own, source, match_n, context)
        out = []
        for h, t, oh, ot in zip(c.hits, c.tries, own.hits, own.tries):
            others = max(t - ot, 0.0)
            scale = min(1.0, CARRY / others) if others > 1e-9 else 0.0
            out.append((oh + scale * max(h - oh, 0.0), ot + scale * others))
        return out

    def prior_at(self, source: str, context: int | None) -> float:
        """alpha_1 before any evidence: `prior`; the lookup's from `LONG_BUCKET` at most the
        largest alpha (at every position) at which its best cycle is 2 rows or plain, at the
        bucket's shortest context (the bare cost model): there an unproven lookup drafts at 2
        rows until its cycles and shadows show that it predicts, since what a wide cycle that
        fails costs grows with the context. The drafter keeps `prior` (its only evidence, while
        plain, is rare one-row probes, which could not outweigh a pessimistic prior: a batch
        of 2 at 2k whose drafter pays stayed plain, 0.955 of the best fixed width); `alphas`
        offers it 2 rows until its first try at the context size."""
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
        """available: the widest block each source can draft this cycle (default: every source
        at its widest); match_n: the lookup's recurring suffix length -> (source, width);
        (PLAIN, 1) is always a choice. launched: this cycle is a plain step the engine
        launched last cycle (`next_plain` said so), whatever is chosen: a probe falling due
        now waits for the next cycle (taken now, it was lost, and the next step's launch
        with it: 2-5 broken launch chains per 64 tokens cost plain decoding ~4%)."""
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
            self.plain_run, self.probe_again = 0, False   # the lookup needs none: see Shadow
            self.probing = True
            return DRAFTER, 2
        self.plain_run += 1
        return best

    def launch_next(self, choice: tuple[str, int], available: dict[str, int],
                    match_n: int = 0, context: int | None = None) -> bool:
        """Whether a plain step launches the next one (`engine._plain_step`; that cycle is then
        plain whatever it chooses). choice: this cycle's (source, width) from `choose`; a
        draft on a launched step, which could not be made: the chain breaks for it, the next
        cycle free to draft, only when that draft is worth the chain's restart
        (`CostModel.relaunch`), or when its estimate has no evidence yet (only a cycle
        proves it); else as `next_plain`. The next cycle's draft is a lookup's only if the
        launched step's token is the one proposed (alpha_1), and then its match is one token
        longer (`LookupIndex.match` copies on): its worth is the seconds the best cycle at
        that length saves over plain steps, for as many cycles as a run of them lasts.
        long-agent-2k: 3-token suffixes that predict about half the time, whose 4-token
        continuations rarely do, broke 6-12 chains per request (`docs/benchmarks.md`)."""
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
        """Whether the next cycle will be a plain step unless the lookup finds a match: plain
        is the best choice without it, and no drafter probe is due (nothing is changed)."""
        rate = self._rates({s: w for s, w in available.items() if s != LOOKUP}, 0, context)
        best = max(rate, key=rate.get)
        return best[1] == 1 and ((DRAFTER, 2) not in rate or not self.probe_again
                                 and self.plain_run < self._probe_gap(rate, context))

    def _probe_gap(self, rate: dict, context: int | None) -> float:
        """Plain cycles between probes, so that what a probe costs over the plain step it
        replaces stays under `budget[0]` of the plain steps' time while drafting is far from
        paying (its best rate < `far` x plain's), `budget[1]` while it nearly does (probes
        are worth more there). A probe's extra cost grows with the context (two rows'
        attention and the drafter's pass, against one row's): rarer probes at 8k. Far from
        paying, the price includes the launch chain the probe breaks (`costs.probe_steps`)."""
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
        """After a cycle of `width` drafted by `source` that accepted `accepted` drafts (and
        took `seconds`; `match_n` and `context` as given to `choose`); first: the first
        position to count (a `Shadow` following the rest of a verified lookup run)."""
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
        """Tell the governor (`costs.Governor`) what a drafting cycle delivered, against plain
        decoding's timed price here; when its window shows the prices wrong, write them back
        corrected (`corrected`) for the next process."""
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
        """The cost model with each width's prices scaled by what its timed cycles took over
        what the model said, relative to plain steps' own ratio at the same context size (load
        that slows every forward alike cancels out), at the shortest context size where both
        were timed; None where nothing is off by more than `costs.SPREAD`. The drafter's
        cycles scale its pass and the verify alike unless lookup cycles timed the verify."""
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
    """A cycle's correction keys, the first with a few timed cycles wins: this (source, width)
    at this context size, at any size (the model carries it across sizes), for a drafter
    cycle every drafter cycle at this size and at any, every cycle at this size, every cycle
    (on a busy machine the bare model made every untimed width look cheap, and the policy
    wandered through them one by one). The drafter's own fallback keeps plain steps out:
    launched ahead they hide their graph build and ran at ~0.55-0.8 of the calibration here,
    a drafter cycle cannot (its pass and verify wait on each other); priced at the plain
    steps' ratio, its untimed widths looked a third cheaper than they ran, drafting looked
    nearly worth it on HumanEval, where it never is, and the near-paying probe budget (5%)
    was spent there. Plain steps are priced by their own keys only (`price_keys`; untimed:
    the calibrated chain, `CostModel.plain`), though they teach every cycle's: priced at
    the drafting cycles' ratio, plain decoding looked as dear as a 2-row drafter cycle, was
    never chosen, so never timed (chat prompts, alone: 75 drafter cycles at tau ~1.2 in
    3 x 64 tokens, 0.85x b=1). (Plain teaching none, untimed lookup widths priced at the
    drafter's ratio were never tried: 0.77-0.79 of the best fixed choice in simulation at
    8k with a calibration blind to the context.)"""
    bucket = context_bucket(context)
    keys = ((source, width, bucket), (source, width, None))
    if source in (DRAFTER, LOOKUP):
        keys += ((source, bucket), (source, None))
    return keys + (("all", bucket), ("all", None))


def price_keys(source: str, width: int, context: int | None) -> tuple:
    """The keys a cycle is priced by: its `cycle_keys`, but a plain step's own only (it
    teaches the others, and borrows from none: see `cycle_keys`)."""
    keys = cycle_keys(source, width, context)
    return keys[:2] if source == PLAIN else keys


class Shadow:
    """Learns a source's acceptance without verifying its drafts: a proposal that no cycle
    verified (the lookup's, while the policy decoded plainly or drafted from the drafter) is
    scored against the tokens that did commit, and the policy is told what a cycle would have
    accepted (`update` without seconds). Greedy, that is exactly the acceptance; sampling, a
    committed token equals a proposed lookup token with probability p(token), the point-mass
    acceptance, so the estimate is unbiased (a sampled drafter token would match with
    probability sum_x q(x) p(x), below the true acceptance: not a use for it). One proposal is
    followed at a time, as cycles would (no overlapping, correlated copies), so the lookup is
    never probed with a verify that costs time."""

    def __init__(self, policy, source: str = LOOKUP):
        self.policy, self.source = policy, source
        # (proposal, match_n, context, the first position to count); committed since
        self.open: tuple[list[int], int, int | None, int] | None = None
        self.seen: list[int] = []

    def offer(self, guess, match_n: int = 0, context: int | None = None) -> None:
        """A proposal (token ids) this cycle does not verify; ignored while one is followed."""
        if guess and self.open is None:
            self.open, self.seen = (list(guess), match_n, context, 1), []

    def follow(self, source: str, width: int, accepted: int, guess, match_n: int = 0,
               context: int | None = None) -> None:
        """After a verified cycle, before its commit: one of this shadow's source that
        accepted all its width - 1 drafts of a longer proposal `guess` (and counted them) has
        the rest of its run followed from position `width` (the bonus token's), its tokens to
        come with this cycle's commit; any other cycle, or one while a proposal is followed,
        is ignored (a run restarted by every cycle that copies on would only ever be counted
        where it ends soon). Counting only the bonus (position `width`), as a first version
        did, left a position a little past the chosen width that missed once untried for
        good."""
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

