"""What a forward costs, as a function of the rows it computes and the context it reads.

`CostModel.verify(rows, context)` (the target's forward) and `draft(width, context)` (the
drafter's pass) are each

    table[rows] + (context - base) * (per_row * rows + per_forward)

`table` timed per width at a short context `base`, the slopes fitted after a longer one
(attention's softmax `exp` per key and row). In a batch `rows` is B x T and `context` its
cache's slots. `Correction` scales the model by the seconds timed, per key; `Governor` holds
drafting to what it delivers against plain decoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .fitted import FIT

BASE_CONTEXT = 128         # the per-width tables are timed after this many tokens
# a calibration whose rounds disagree by more (`calibration.round_spread`) is timed again
SPREAD = 0.10
GOVERNOR_WINDOW = 16       # drafting cycles per governor window
# plain steps that time plain decoding where it never ran (`MachineFit.trusted_chain` and 3 more)
REFERENCE_STEPS = 12


@dataclass(frozen=True)
class CostModel:
    """draft_table / verify_table: seconds at `base` context, index w-1 for width w (the
    drafter's up to its block size, 0.0 at w = 1). *_slope: (per_row, per_forward) extra
    seconds per context token. plain_step: a plain step in a chain launched ahead (mlx-lm's
    double buffering), as plain decoding runs (None: the one-row verify)."""

    draft_table: tuple[float, ...]
    verify_table: tuple[float, ...]
    base: int = BASE_CONTEXT
    verify_slope: tuple[float, float] = (0.0, 0.0)
    draft_slope: tuple[float, float] = (0.0, 0.0)
    plain_step: float | None = None
    fitted: bool = True        # False: the long contexts timed no slower (a busy machine)
    spread: float = 0.0        # how far the calibration's rounds disagreed (0.0: not measured)

    @property
    def settled(self) -> bool:
        """Kept for later processes: slopes fitted, rounds within `SPREAD`."""
        return self.fitted and self.spread <= SPREAD

    def verify(self, rows: int, context: int | None = None) -> float:
        """Seconds of a target forward of `rows` rows reading `context` keys (None: base)."""
        return _at(self.verify_table, rows) + self._extra(self.verify_slope, rows, context)

    def plain(self, rows: int = 1, context: int | None = None) -> float:
        """A plain step of `rows` sequences in a chain launched ahead: the verify less the
        graph build the chain hides (`relaunch`)."""
        return self.verify(rows, context) - self.relaunch

    @property
    def relaunch(self) -> float:
        """Seconds of graph build a chain of launched plain steps hides and its first step
        pays: what breaking a chain costs."""
        return 0.0 if self.plain_step is None else max(self.verify_table[0] - self.plain_step,
                                                       0.0)

    def draft(self, width: int, context: int | None = None) -> float:
        """A drafter pass of a `width`-row block (0 at width 1: nothing drafted)."""
        if width <= 1:
            return 0.0
        return _at(self.draft_table, width) + self._extra(self.draft_slope, width, context)

    def cycle(self, width: int, source: str = "drafter", context: int | None = None) -> float:
        """A cycle: the verify, plus the drafter's pass if it drafted (a lookup is free); a
        plain step as it runs in a chain."""
        if width <= 1 and source == "plain":
            return self.plain(1, context)
        draft = self.draft(width, context) if source == "drafter" else 0.0
        return self.verify(width, context) + draft

    @property
    def max_width(self) -> int:
        return len(self.verify_table)

    def _extra(self, slope: tuple[float, float], rows: int, context: int | None) -> float:
        if context is None:
            return 0.0
        per_row, per_forward = slope
        return (max(context, 0) - self.base) * (per_row * rows + per_forward)

    def to_dict(self) -> dict:
        return {"draft": list(self.draft_table), "verify": list(self.verify_table),
                "base": self.base, "verify_slope": list(self.verify_slope),
                "draft_slope": list(self.draft_slope), "plain_step": self.plain_step,
                "fitted": self.fitted, "spread": self.spread}

    @classmethod
    def from_dict(cls, entry, draft_widths: int, verify_widths: int) -> "CostModel | None":
        """The model of a well-formed `to_dict` entry (tables of `draft_widths` and
        `verify_widths` non-negative numbers, two slopes of two), else None: measured again."""
        if not isinstance(entry, dict):
            return None
        fields = {"draft": draft_widths, "verify": verify_widths, "verify_slope": 2,
                  "draft_slope": 2}
        ok = all(isinstance(xs, list) and len(xs) == n and all(_number(x) for x in xs)
                 for xs, n in ((entry.get(k), n) for k, n in fields.items()))
        base, plain = entry.get("base"), entry.get("plain_step")
        fitted = entry.get("fitted", any(entry["verify_slope"]) if ok else True)
        spread = entry.get("spread", 0.0)
        if not ok or not (_number(base) and base == int(base)) or not (
                plain is None or _number(plain) and plain > 0) or not isinstance(
                fitted, bool) or not _number(spread):
            return None
        return cls(tuple(map(float, entry["draft"])), tuple(map(float, entry["verify"])),
                   int(base), tuple(map(float, entry["verify_slope"])),
                   tuple(map(float, entry["draft_slope"])),
                   None if plain is None else float(plain), fitted, float(spread))


class Correction:
    """The online correction of a `CostModel`: timed over modelled seconds per key, decayed
    by `decay` per observation. Callers list keys most specific first; the first with `trust`
    observations prices (the model's figure times its ratio)."""

    def __init__(self, decay: float = 0.95, trust: float = 3.0):
        self.decay, self.trust = decay, trust
        self.table: dict = {}                 # key -> (count, timed s, modelled s), decayed
        self.memo: dict = {}                  # callers' derived values, until the table changes
        self.governor = Governor()

    def ratio(self, keys) -> float:
        """Timed over modelled seconds of the first trusted key (1.0: none is)."""
        r = self.trusted(keys)
        return 1.0 if r is None else r

    def trusted(self, keys) -> float | None:
        """Timed over modelled seconds of the first trusted key (None: none is)."""
        for key in keys:
            count, seconds, modelled = self.table.get(key, (0.0, 0.0, 0.0))
            if count >= self.trust and modelled > 0:
                return seconds / modelled
        return None

    def blend(self, keys, prior: float) -> float:
        """The ratio of the first key timed at all, its missing observations (up to `trust`)
        counted at `prior`: a shape's first timings move its price at once."""
        for key in keys:
            count, seconds, modelled = self.table.get(key, (0.0, 0.0, 0.0))
            if count > 0 and modelled > 0:
                lack = max(self.trust - count, 0.0) * modelled / count
                return (seconds + prior * lack) / (modelled + lack)
        return prior

    def observe(self, keys, seconds: float, modelled: float,
                estimate: float | None = None) -> None:
        """Something priced at `modelled` seconds took `seconds`: every key learns it, at most
        twice the current `estimate` (default `ratio(keys)`), so a one-off stall cannot swamp."""
        keys = list(keys)
        if modelled <= 0 or seconds <= 0:
            return
        estimate = self.ratio(keys) if estimate is None else estimate
        seconds = min(seconds, 2.0 * modelled * estimate)
        d = self.decay
        self.memo.clear()
        for key in keys:
            count, total, model_total = self.table.get(key, (0.0, 0.0, 0.0))
            self.table[key] = (count * d + 1, total * d + seconds, model_total * d + modelled)


class Governor:
    """Holds drafting to what it delivers, whatever the prices say: per key (a source, the
    batch), its latest `window` drafting cycles against plain decoding timed in this process.
    A window that lost holds the key plain for as many steps as make its loss `budget` of
    theirs. Where plain decoding was never timed, a full window holds every key for
    `REFERENCE_STEPS` plain steps, once per context size, to time it."""

    def __init__(self, window: int = GOVERNOR_WINDOW, budget: float = 0.01):
        self.window, self.budget = window, budget
        self.recent: dict = {}          # key -> [(tokens, seconds, plain seconds per token)]
        self.hold: dict = {}            # key -> plain steps left before it drafts again
        self.referenced: set = set()    # context sizes whose reference was asked for
        self.trips = 0
        # a batched drafting step not yet counted: [tokens, seconds, sequences, slots, probe]
        self.pending: list | None = None

    def held(self, key) -> bool:
        return self.hold.get(key, 0) > 0 or self.hold.get(None, 0) > 0

    def plain_step(self) -> None:
        """A plain step ran: every hold is a step shorter."""
        for key in list(self.hold):
            self.hold[key] -= 1
            if self.hold[key] <= 0:
                del self.hold[key]

    def drafted(self, key, tokens: float, seconds: float, plain: float | None,
                plain_step: float, bucket: int = 0) -> bool:
        """A drafting cycle of `key` committed `tokens` in `seconds`; plain: plain decoding's
        timed seconds per token here (None: untimed); plain_step: to size holds -> whether a
        hold begins (the window shows the prices wrong)."""
        if plain is None:
            if bucket not in self.referenced and len(self.recent.get(key, ())) >= self.window:
                self.referenced.add(bucket)
                self.hold[None] = REFERENCE_STEPS
            window = self.recent.setdefault(key, [])
            window[:] = (window + [(tokens, seconds, None)])[-self.window:]
            return False
        window = self.recent.setdefault(key, [])
        window[:] = [(t, s, plain if p is None else p)
                     for t, s, p in window + [(tokens, seconds, plain)]][-self.window:]
        if len(window) < self.window:
            return False
        lost = sum(s - t * p for t, s, p in window)
        if lost <= 0:
            return False
        self.hold[key] = math.ceil(lost / self.budget / plain_step)
        self.trips += 1
        window.clear()
        return True


def probe_steps(extra: float, near: bool) -> float:
    """What one probe costs, in plain steps: `extra` over the plain step it replaces, and,
    far from paying (not `near`), the launch chain it breaks (`MachineFit.relaunch`)."""
    return max(extra, 0.0) + (0.0 if near else FIT.relaunch)


def drafter_pass(seconds) -> float:
    """Seconds of ONE drafter pass for sequences whose passes alone take `seconds` (0: not
    drafting): the dearest whole, each other one's `MachineFit.batch_draft_share`."""
    total = top = 0.0
    for d in seconds:
        total, top = total + d, max(top, d)
    return pass_seconds(total, top)


def pass_seconds(total: float, top: float) -> float:
    """`drafter_pass` from the sum and the largest of the passes alone."""
    return top + FIT.batch_draft_share * (total - top)


def context_bucket(context: int | None) -> int:
    """Context sizes corrected apart: 0 below 512 tokens (and None), then one per doubling."""
    return max((context or 0).bit_length() - 9, 0)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0


def _at(table: tuple[float, ...], rows: int) -> float:
    """table[rows - 1], extrapolated past its end (a batch verifies more rows) at the table's
    mean slope, not its last step (the monotone fit often ends on a plateau)."""
    if rows <= len(table):
        return table[rows - 1]
    n = len(table)
    step = (table[-1] - table[0]) / (n - 1) if n > 1 else table[-1]
    return table[-1] + (rows - n) * max(step, 0.0)


def monotone(xs: list[float]) -> list[float]:
    """Least-squares nondecreasing fit (pool adjacent violators): a wider block never costs
    less."""
    blocks: list[list[float]] = []                 # [mean, count]
    for x in xs:
        blocks.append([x, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    return [m for m, n in blocks for _ in range(int(n))]


