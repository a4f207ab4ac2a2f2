"""What a forward costs, as a function of the rows it computes and the context it reads.

`CostModel.verify(rows, context)` is the target's forward of `rows` new rows whose attention
reads `context` keys each; `draft(width, context)` the drafter's pass of a `width`-row block
over `context` rows of target features. Both are

    table[rows] + (context - base) * (per_row * rows + per_forward)

with `table` measured per width at a short context `base` (it keeps the uneven shape that
BLAS blocking gives the width axis) and the two context slopes fitted from forwards timed
after a few longer contexts. Attention is why the slope exists: every verified row runs one
softmax `exp` per key, and on MLX's CPU backend an `exp` costs ~20x a multiply-add, so at 8k
tokens a 16-row verify costs several plain steps (SPEC.md section 10); `per_forward` is what
grows with the context once per forward (the cache's slices, the mask).

A batch (`batch.BatchAwareWidth`): `rows` is every row of the forward (B sequences x T rows),
`context` the slots of the batch cache, which every row's attention reads (the longest row and
its holes): the attention term is then rows x context, as it is computed; its drafting
sequences share one drafter pass, `drafter_pass` of their passes alone. Rows beyond the
measured table extrapolate its last step. `Correction` is the online correction of both: the
timed seconds over the model's, per key.

Timings come from `measure_costs` (a few seconds, once per machine and model pair; cached by
`calibration.load_or_measure_costs`): plain steps and every width timed in each round, rounds
repeated until they agree (`SPREAD`); one whose rounds do not is timed again at the next load.
The long contexts are made cheaply: the target's caches are filled with random keys and values
(the cost of attention does not depend on them), the drafter's with random features, so no
quadratic prefill runs. `Governor` keeps a policy's drafting to what it delivers against plain
decoding, whatever the prices say.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BASE_CONTEXT = 128                 # the per-width tables are timed after this many tokens
# A calibration is settled when its rounds agree within this (`round_spread`): one whose
# rounds disagree more was taken beside other work, and is timed again at the next load.
SPREAD = 0.10
# The governor (`Governor`): drafting cycles per window; plain steps that time plain decoding
# where it never ran (a chain long enough for `engine.TRUSTED_CHAIN`, and three timed steps)
GOVERNOR_WINDOW = 16
REFERENCE_STEPS = 12


@dataclass(frozen=True)
class CostModel:
    """draft_table / verify_table: seconds at `base` context, index w-1 for width w (the
    drafter's pass up to its block size, 0.0 at w = 1; the verify up to the widest any source
    drafts). *_slope: (per_row, per_forward) extra seconds per context token. plain_step: a
    plain step in a chain of them launched ahead (mlx-lm's double buffering: each step's
    graph is built while the one before computes) at `base` context, as plain decoding runs
    (None: the one-row verify). Priced as the synchronous one-row verify, plain decoding
    looked as dear as a 2-row drafter cycle here; a policy that drafted every cycle then
    never timed a plain step to learn otherwise (140 drafter cycles at tau 1.19 on the chat
    prompts, alone: 0.72x plain)."""

    draft_table: tuple[float, ...]
    verify_table: tuple[float, ...]
    base: int = BASE_CONTEXT
    verify_slope: tuple[float, float] = (0.0, 0.0)
    draft_slope: tuple[float, float] = (0.0, 0.0)
    plain_step: float | None = None
    # False: the slopes could have been measured but every try timed the long contexts no
    # slower (a busy machine); `calibration.load_or_measure_costs` times them again next time
    fitted: bool = True
    # how far the calibration's rounds disagreed (`round_spread`; 0.0: not measured)
    spread: float = 0.0

    @property
    def settled(self) -> bool:
        """Whether to keep it for later processes: slopes fitted, rounds within `SPREAD`."""
        return self.fitted and self.spread <= SPREAD

    def verify(self, rows: int, context: int | None = None) -> float:
        """Seconds of a target forward of `rows` rows reading `context` keys (None: base)."""
        return _at(self.verify_table, rows) + self._extra(self.verify_slope, rows, context)

    def plain(self, rows: int = 1, context: int | None = None) -> float:
        """Seconds of a plain step of `rows` sequences (one row each) in a chain launched
        ahead: the verify less the graph build the chain hides (`relaunch`)."""
        return self.verify(rows, context) - self.relaunch

    @property
    def relaunch(self) -> float:
        """Seconds of the graph build a chain of plain steps launched ahead hides, which a
        chain's first step pays (`plain_step` against the one-row verify, a fixed amount per
        forward): what breaking a chain costs."""
        return 0.0 if self.plain_step is None else max(self.verify_table[0] - self.plain_step,
                                                       0.0)

    def draft(self, width: int, context: int | None = None) -> float:
        """Seconds of a drafter pass of a `width`-row block (0 at width 1: nothing drafted)."""
        if width <= 1:
            return 0.0
        return _at(self.draft_table, width) + self._extra(self.draft_slope, width, context)

    def cycle(self, width: int, source: str = "drafter", context: int | None = None) -> float:
        """A cycle of `width` rows: the verify, and the drafter's pass if it drafted (a lookup
        drafts for free); a plain step (width 1, source "plain") as it runs in a chain."""
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
        """The model an entry of `to_dict` describes when it is well formed (tables of
        `draft_widths` and `verify_widths` non-negative numbers, two slopes of two), else None:
        a file edited by hand or written by another version is measured again, not trusted."""
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
    """The online correction of a `CostModel`: the seconds timed over the seconds the model
    said, decayed by `decay` per observation, per key (a policy's keys: a (source, width) at a
    context size, a batch step's rows at a context size, ...). `ratio(keys)` is the first key
    with `trust` observations or more, so a caller lists its keys from the most specific to
    the most general; the model's figure times the ratio is the estimate."""

    def __init__(self, decay: float = 0.95, trust: float = 3.0):
        self.decay, self.trust = decay, trust
        self.table: dict = {}                 # key -> (count, timed s, modelled s), decayed
        # what callers derive from the table (a batch step's seeded ratio per shape, asked by
        # every sequence of a step), kept until the table next changes
        self.memo: dict = {}
        # what the timed cycles say drafting delivers against plain decoding (shared alike)
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
        counted at `prior` (all missing: prior): a shape's first timings move its price at
        once, not after `trust` of them."""
        for key in keys:
            count, seconds, modelled = self.table.get(key, (0.0, 0.0, 0.0))
            if count > 0 and modelled > 0:
                lack = max(self.trust - count, 0.0) * modelled / count
                return (seconds + prior * lack) / (modelled + lack)
        return prior

    def observe(self, keys, seconds: float, modelled: float,
                estimate: float | None = None) -> None:
        """Something the model prices at `modelled` seconds took `seconds`; every key learns
        it. A one-off stall (first-use compilation, the OS) must not swamp the estimate: at
        most twice the current one (`estimate`, default `ratio(keys)`) counts."""
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
    batch's steps), the tokens and seconds of its latest `window` drafting cycles against what
    plain decoding, timed in this process, would have taken for those tokens. A window that
    delivered less holds the key for as many plain steps as make the seconds it lost
    `budget` of theirs; then it may draft again, and a window that loses again holds it
    again: what re-trying costs stays within `budget` of the time. Where plain decoding has
    not been timed, a full window holds every key for `REFERENCE_STEPS` plain steps, once per
    context size (`referenced`): a calibration that priced it dear would otherwise never let
    it run to be timed."""

    def __init__(self, window: int = GOVERNOR_WINDOW, budget: float = 0.01):
        self.window, self.budget = window, budget
        self.recent: dict = {}          # key -> [(tokens, seconds, plain seconds per token)]
        self.hold: dict = {}            # key -> plain steps left before it drafts again
        self.referenced: set = set()    # context sizes whose reference was asked for
        self.trips = 0
        # a batched drafting step not yet counted: [tokens, seconds, sequences, context, probe]
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
        timed seconds per token at its context (None: not timed yet); plain_step: a plain
        step's seconds, to size holds -> whether the window shows the prices wrong (a hold
        begins)."""
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


# One drafter pass drafts for every drafting sequence of a batched step
# (`Drafter.propose_batch`): each sequence beyond the dearest adds this share of its pass
# alone (benchmarks/drafter_batch.py, width 8: n passes / one pass 1.39, 2.27, 2.64, 2.38 at
# n = 2, 4, 8, 16, about 27 ms per extra sequence beside a 55 ms pass alone; docs/batching.md).
BATCH_DRAFT_SHARE = 0.5


# What restarting a chain of plain steps launched ahead costs, in plain steps: the first step
# of a chain runs its graph build unhidden and waits for the launched step with it (a chain
# start took ~2.45 plain steps of time for its 2 steps here, timing `auto --no-lookup` cycle
# by cycle; docs/benchmarks.md). A drafting cycle between plain steps pays it once; the probe
# gap prices it.
RELAUNCH = 0.5


def probe_steps(extra: float, near: bool) -> float:
    """What one probe costs, in plain steps: `extra`, its cycle's cost over the plain step it
    replaces (in plain steps), and far from paying the launch chain it breaks (`RELAUNCH`).
    Near paying, not: the simulations lost 1-4% at alpha 0.35 with it (fewer probes there)."""
    return max(extra, 0.0) + (0.0 if near else RELAUNCH)


def drafter_pass(seconds) -> float:
    """Seconds of ONE drafter pass for sequences whose passes alone would take `seconds`
    (0: not drafting): the dearest whole, every other one's `BATCH_DRAFT_SHARE`."""
    total = top = 0.0
    for d in seconds:
        total, top = total + d, max(top, d)
    return pass_seconds(total, top)


def pass_seconds(total: float, top: float) -> float:
    """`drafter_pass` from the sum and the largest of the passes alone."""
    return top + BATCH_DRAFT_SHARE * (total - top)


def context_bucket(context: int | None) -> int:
    """Context sizes corrected apart: 0 below 512 tokens (and None), then one per doubling."""
    return max((context or 0).bit_length() - 9, 0)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0


def _at(table: tuple[float, ...], rows: int) -> float:
    """table[rows - 1], extrapolated linearly past its end (a batch verifies more rows) at
    the table's mean slope: the monotone fit often ends on a plateau, and its last step alone
    (0 there) priced a 64-row batch step as a 16-row one, so the batch policy drafted wide."""
    if rows <= len(table):
        return table[rows - 1]
    n = len(table)
    step = (table[-1] - table[0]) / (n - 1) if n > 1 else table[-1]
    return table[-1] + (rows - n) * max(step, 0.0)


def monotone(xs: list[float]) -> list[float]:
    """Least-squares nondecreasing fit (pool adjacent violators): a wider block never costs
    less, whatever the timing noise said."""
    blocks: list[list[float]] = []                 # [mean, count]
    for x in xs:
        blocks.append([x, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    return [m for m, n in blocks for _ in range(int(n))]


