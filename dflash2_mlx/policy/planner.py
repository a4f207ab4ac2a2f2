"""The planner: what the engine asks once per step for every row, and tells what the step did.

For each running sequence it takes an `Offer` (what its sources can draft now) and returns a
`Decision`: the source and width to verify, and whether its next step is a plain one that may
launch ahead. The rows' own width policies choose in row order, the batch-aware ones priced for
the whole step; where plain decoding of every row is worth more than what they chose, every row
decodes plainly. Once the step has drafted, `cut` looks again with each draft's predicted
acceptance (`acceptance`, `cut`): `auto` rows verify only what pays. After the step, `learn`
times it and tells each policy, and the acceptance model, what it accepted.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..decode.sequence import Drafted, Offer, WidthPolicy
from ..decode.stats import DRAFTER, LOOKUP, PLAIN
from .acceptance import MatchModel, SurenessModel, predicted
from .adaptive import AdaptiveWidth, FixedWidth, LookupShadow
from .batch import BatchAwareWidth, Want, outlooks_after, plain_is_better
from .costs import Correction, drafter_pass
from .cut import cut_alone, cut_batch
from .fitted import FIT

PLAIN_WANT = Want()


class Decision(NamedTuple):
    """One row's part of a step."""

    source: str                # DRAFTER | LOOKUP | PLAIN
    width: int                 # rows verified
    launch: bool = False       # its next step is plain, launched ahead where the batch's is
    # its next step is plain too if this all-plain step launches the next one: the batch is
    # better plain though its policy wanted to draft
    with_batch: bool = False


class Planned(NamedTuple):
    """What `learn` needs of a row's plan: its decision and what it was chosen from; drafted:
    the width it drafted (more than `width` where `cut` narrowed it)."""

    rid: int
    source: str
    width: int
    want: Want
    match: int
    guess: list[int] | None
    context: int
    drafted: int


class Planner:
    """Plans the steps of one engine. `join(rid, policy)` when a sequence starts decoding,
    `plan(rids, offers, slots)` each step, `learn(...)` after it, `leave(rid)` when it ends.
    shared: the correction of the batch's step prices, which its batch-aware policies share.
    acceptance: the drafter's acceptance model (`SurenessModel`), matches: the lookup's
    (`MatchModel`), both kept by the pipeline so that they learn across generations (default:
    its own)."""

    def __init__(self, acceptance: SurenessModel | None = None,
                 matches: MatchModel | None = None):
        self.shared = Correction(decay=FIT.batch_decay)
        self.policies: dict[int, WidthPolicy] = {}
        self.shadows: dict[int, LookupShadow] = {}
        self.timer = PlainStepTimer()
        self.planned: list[Planned] = []
        self.acceptance = acceptance if acceptance is not None else SurenessModel(16)
        self.matches = matches if matches is not None else MatchModel(16)
        self.drafted: list[Drafted | None] = []
        self.host: dict[int, tuple] = {}                 # `_host`: this step's, by row
        self.predicted: list[np.ndarray | None] = []

    def policy(self, width: int | str, estimates: AdaptiveWidth | None,
               alone: bool) -> WidthPolicy:
        """A new sequence's width policy for block size `width`: fixed, or for "auto" its own
        policy over the pipeline's `estimates` (shared acceptance and costs), priced for the
        batch's steps unless the engine decodes its sequences alone."""
        if width != "auto":
            return FixedWidth(width)
        own = estimates.for_sequence()
        return own if alone else BatchAwareWidth(own, self.shared)

    def join(self, rid: int, policy: WidthPolicy | None) -> None:
        """A sequence starts decoding with its own width policy (None: plain decoding)."""
        policy = policy if policy is not None else FixedWidth(1)
        self.policies[rid], self.shadows[rid] = policy, LookupShadow(policy, LOOKUP)

    def leave(self, rid: int) -> None:
        self.policies.pop(rid, None)
        self.shadows.pop(rid, None)

    def plan(self, rids: list[int], offers: list[Offer],
             slots: int | None) -> tuple[list[Decision], bool]:
        """Every row's decision, in row order -> (decisions, whether drafting was overruled:
        plain decoding of every row beats what they chose). slots: the keys each row reads."""
        policies = [self.policies[rid] for rid in rids]
        later = outlooks_after(policies)                          # O(B W), once per step
        decisions, wants, planned = [], [], []
        for i, (policy, offer) in enumerate(zip(policies, offers)):
            if isinstance(policy, BatchAwareWidth):
                policy.set_batch(planned, later[i + 1], slots)
            source, width = policy.choose(offer.available, offer.match, offer.context,
                                          offer.launched)
            e, d = policy.last
            want = PLAIN_WANT if source == PLAIN else \
                Want(width, e, d if source == DRAFTER else 0.0)
            if offer.launched:                   # launched last step: plain, whatever it chose
                decision = Decision(PLAIN, 1)
            else:
                decision = Decision(source, width)
            if decision.source == PLAIN:
                decision = decision._replace(launch=offer.room > 1 and policy.launch_next(
                    (source, width), offer.available, offer.match, offer.context + 1))
            decisions.append(decision)
            wants.append(want)
            planned.append(want if decision.width > 1 else PLAIN_WANT)
        plain_wins = plain_is_better(list(zip(policies, wants)), slots)
        overruled = plain_wins and any(d.width > 1 for d in decisions)
        if overruled:
            decisions = [d if d.width == 1 else Decision(PLAIN, 1) for d in decisions]
        held = [i for i, (d, o) in enumerate(zip(decisions, offers))
                if not d.launch and o.room > 1]
        if held and plain_wins and all(wants[i].width > 1 for i in held):
            for i in held:
                decisions[i] = decisions[i]._replace(with_batch=True)
        self.planned = []
        for rid, d, want, offer in zip(rids, decisions, wants, offers):
            if d.source != LOOKUP:               # a proposal no cycle verifies: its shadow's
                self.shadows[rid].offer(offer.guess, offer.match, offer.context)
            self.planned.append(Planned(rid, d.source, d.width, want, offer.match,
                                        offer.guess, offer.context, d.width))
        self.drafted, self.host, self.predicted = [], {}, []
        return decisions, overruled

    # ---- after drafting
    def cut(self, drafted: list[Drafted | None]) -> list[int]:
        """Each row's verify width once the step has drafted (`policy.cut`): `auto` rows
        (`AdaptiveWidth`, `BatchAwareWidth`) keep what their predicted acceptance pays for,
        fixed widths stay. Reads the predictions on the host (a sync) only where some row
        may be cut."""
        self.drafted, self.host = list(drafted), {}
        self.predicted = [None] * len(self.planned)
        widths = [p.width for p in self.planned]
        cuts = [p.width > 1 and _adaptive(self.policies[p.rid]) is not None
                for p in self.planned]
        if not any(cuts):
            return widths
        for i, p in enumerate(self.planned):
            if p.width > 1:
                self.predicted[i] = self._predict(i)
        if len(self.planned) == 1:
            p, inner = self.planned[0], _adaptive(self.policies[self.planned[0].rid])
            widths = [cut_alone(inner, p.source, p.width, self.predicted[0], p.context)]
        else:
            batch = next((q for q in (self.policies[p.rid] for p in self.planned)
                          if isinstance(q, BatchAwareWidth)), None)
            if batch is None:
                return widths
            draft_s = drafter_pass(p.want.draft_s for p in self.planned if p.width > 1)
            T = cut_batch(batch, widths, self.predicted, [not c for c in cuts],
                          batch.slots, draft_s)
            widths = [min(w, T) if c else w for w, c in zip(widths, cuts)]
        self.planned = [p._replace(width=w, source=PLAIN if w == 1 else p.source)
                        for p, w in zip(self.planned, widths)]
        return widths

    def _predict(self, i: int) -> np.ndarray:
        """Row i's a_1..a_{w-1}: `acceptance.predicted` from its draft (`_host`)."""
        p = self.planned[i]
        sure, confidence = self._host(i)
        inner = _adaptive(self.policies[p.rid])
        return predicted(p.source, p.drafted, sure, confidence, self.acceptance,
                         lambda: inner.alphas(p.source, p.match, p.context) if inner else
                         list(self.matches.predict(p.match, p.drafted - 1)))

    def _host(self, i: int) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Row i's sureness [w-1, 2] and confidence [w-1] on the host, read once a step."""
        if i not in self.host:
            d = self.drafted[i] if i < len(self.drafted) else None
            self.host[i] = (None, None) if d is None else \
                tuple(None if a is None else np.array(a[0]) for a in d)
        return self.host[i]

    def predictions(self, row: int) -> tuple[float, ...]:
        """Row i's predicted acceptance per drafted position (read after its verify)."""
        if row >= len(self.planned) or self.planned[row].drafted < 2:
            return ()
        if self.predicted[row] is None:
            self.predicted[row] = self._predict(row)
        return tuple(float(x) for x in self.predicted[row])

    def learn(self, T: int, slots: int | None, accepted: list[int], new: list[list[int]],
              seconds: float, was_launched: bool, launches: bool) -> None:
        """The step just planned verified T rows per sequence over `slots` keys in `seconds`:
        row i accepted `accepted[i]` drafts and committed `new[i]`; was_launched: it was
        launched by the step before; launches: it launched the next one."""
        n = len(self.planned)
        drafted = any(p.drafted > 1 for p in self.planned)
        alone = seconds if n == 1 else None
        if T == 1 and not drafted:
            seconds = self.timer.plain(seconds, was_launched, launches)
            alone = seconds if alone is not None and self.timer.long(launches) else None
        elif T == 1:
            alone = None                     # drafted, then cut to plain: no plain price
        self._learn_acceptance(accepted)
        draft_s = drafter_pass(p.want.draft_s if p.drafted > 1 else 0.0 for p in self.planned)
        batch = {id(q.shared): q for q in (self.policies[p.rid] for p in self.planned)
                 if isinstance(q, BatchAwareWidth)}            # one per shared correction
        for policy in batch.values():
            policy.observe(n, T, slots, seconds, draft_s, sum(accepted) + n)
        for p, a, tokens in zip(self.planned, accepted, new):
            self.policies[p.rid].update(p.source, p.width, a, alone, p.match, p.context)
            shadow = self.shadows[p.rid]
            shadow.follow(p.source, p.width, a, p.guess, p.match, p.context)
            shadow.commit(tokens)

    def _learn_acceptance(self, accepted: list[int]) -> None:
        """The verified rows teach the acceptance models: the drafter's `SurenessModel`, the
        lookup's `MatchModel`."""
        for i, (p, a) in enumerate(zip(self.planned, accepted)):
            if p.source == LOOKUP and p.width > 1:
                self.matches.learn(p.match, p.width, a)
            sure = self._host(i)[0] if p.source == DRAFTER else None
            if sure is not None:
                self.acceptance.learn(sure, p.width, a)


def _adaptive(policy) -> AdaptiveWidth | None:
    """The adaptive policy a row's width policy is or wraps, where it lets the planner cut
    its blocks (None: a fixed width, or one that does not)."""
    policy = policy.inner if isinstance(policy, BatchAwareWidth) else policy
    return policy if isinstance(policy, AdaptiveWidth) and policy.cut else None


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
        """Whether the chain of the step just reported is long enough (`MachineFit.
        trusted_chain`) to say what plain decoding costs: a short chain's steps each pay its
        unhidden start."""
        return self.steps + launches >= FIT.trusted_chain
