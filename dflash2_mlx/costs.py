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
`adaptive.load_or_measure_costs`): plain steps and every width timed in each round, rounds
repeated until they agree (`SPREAD`); one whose rounds do not is timed again at the next load.
The long contexts are made cheaply: the target's caches are filled with random keys and values
(the cost of attention does not depend on them), the drafter's with random features, so no
quadratic prefill runs. `Governor` keeps a policy's drafting to what it delivers against plain
decoding, whatever the prices say.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, replace

import mlx.core as mx

from . import log
from .sampling import Sampling

BASE_CONTEXT = 128                 # the per-width tables are timed after this many tokens
# The slopes are fitted from forwards after these contexts, at these widths (those <= the
# widest): attention's cost is linear in the keys, so one long context and three widths pin
# both slopes; more would cost seconds of calibration on every new machine.
LONG_CONTEXTS = (2048,)
SLOPE_WIDTHS = (1, 4, 16)
CHAIN_STEPS = 16         # plain steps per timed chain (its unhidden first build amortised)
SLOPE_TRIES = 3          # long-context timings taken again while they fit no slope at all
# A calibration is settled when its rounds agree within this (`round_spread`): one whose
# rounds disagree more was taken beside other work, and is timed again at the next load.
SPREAD = 0.10
CALIBRATION_BUDGET = 40.0    # seconds of rounds a calibration may spend trying to settle
MAX_ROUNDS = 12
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
    # slower (a busy machine); `adaptive.load_or_measure_costs` times them again next time
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


def fit_slope(points: list[tuple[int, int, float]]) -> tuple[float, float]:
    """Least squares of extra = dn * (per_row * w + per_forward) over (w, dn, extra) points
    (extra: seconds over the same width at base context, dn: context over base) -> the two
    slopes, each >= 0 (noise must not make a longer context look cheaper)."""
    sxx = sxy = syy = sx = sy = 0.0
    for w, dn, extra in points:
        x, y = dn * w, float(dn)
        sxx, sxy, syy = sxx + x * x, sxy + x * y, syy + y * y
        sx, sy = sx + x * extra, sy + y * extra
    det = sxx * syy - sxy * sxy
    if not points or det <= 1e-12 * max(sxx * syy, 1e-300):
        per_row = sx / sxx if sxx else 0.0                   # one width only: all per row
        return max(per_row, 0.0), 0.0
    per_row, per_forward = (sx * syy - sy * sxy) / det, (sy * sxx - sx * sxy) / det
    if per_forward < 0:
        return max(sx / sxx, 0.0), 0.0
    if per_row < 0:
        return 0.0, max(sy / syy, 0.0)
    return per_row, per_forward


def grow_cache(cache: list, n: int) -> bool:
    """Append n random keys and values to every attention cache of a target (in chunks, so no
    huge temporary) -> False when some layer's cache is not a plain key/value store (a
    recurrent state, quantized keys, a sliding window, which a one-row step rotates beyond
    any rollback): its context cost is then left to the online timing."""
    stores = [c for c in cache if isinstance(getattr(c, "keys", None), mx.array)
              and c.keys.ndim == 4 and hasattr(c, "update_and_fetch")
              and not hasattr(c, "max_size")]
    if len(stores) != len(cache):
        return False
    for start in range(0, n, 1024):
        rows = min(1024, n - start)
        for c in stores:
            b, heads, _, dim = c.keys.shape
            vdim = c.values.shape[-1]
            c.update_and_fetch(mx.random.normal((b, heads, rows, dim)).astype(c.keys.dtype),
                               mx.random.normal((b, heads, rows, vdim)).astype(c.values.dtype))
        mx.eval([(c.keys, c.values) for c in stores])
    return True


def measure_costs(pipeline, max_width: int, context: int = BASE_CONTEXT,
                  long: tuple[int, ...] = LONG_CONTEXTS, reps: int = 3,
                  budget: float = CALIBRATION_BUDGET) -> CostModel:
    """Time a chain of plain steps, the drafter (widths up to its block size; none without a
    drafter) and the verify forward at every width up to `max_width` after a `context`-token
    prompt, all in each round (load that comes and goes shifts them alike), then
    `SLOPE_WIDTHS` at each of the `long` contexts and at `context` again, to fit the context
    slopes (`measure_slopes`). Rounds repeat, at least `reps`, until they agree within
    `SPREAD` or `budget` seconds have passed (`_rounds`); the model keeps the wider spread of
    the two. The fastest of the rounds (other work on the machine only ever adds time); the
    tables are fitted nondecreasing in the width."""
    tic = time.perf_counter()
    target, drafter = pipeline.adapter, pipeline.drafter
    ids = _context_ids(target, context)
    cache = target.make_cache()
    _, feats = target.forward(ids, cache)
    mx.eval(feats, [c.state for c in cache])
    anchor = ids[:, -1:]
    block = drafter.args.block_size if drafter is not None else 1
    dcache = drafter.make_cache() if drafter is not None else None
    if drafter is not None:
        drafter.propose(target, anchor, feats, dcache, 2, Sampling(), mx.random.key(0))
    widths = list(range(1, max(max_width, block) + 1))
    jobs = {("plain", 1): lambda: _time_chain(target, cache, anchor)}
    for w in widths:
        jobs.update(_width_jobs(target, drafter, cache, dcache, anchor, feats, w, block,
                                copy_cache=True))
    best, spread = _rounds(jobs, reps, budget / 2, "calibration")
    draft = [0.0] + monotone([best[("draft", w)] for w in range(2, block + 1)])
    verify = monotone([best[("verify", w)] for w in widths])
    # never dearer than the synchronous step (a chain only hides work)
    plain = min(best[("plain", 1)], verify[0])
    cost = CostModel(tuple(draft), tuple(verify), context, plain_step=plain, spread=spread)
    cost = measure_slopes(pipeline, cost, long, reps, budget - (time.perf_counter() - tic))
    return replace(cost, spread=max(cost.spread, spread))


def measure_slopes(pipeline, cost: CostModel, long: tuple[int, ...] = LONG_CONTEXTS,
                   reps: int = 3, budget: float = CALIBRATION_BUDGET / 2) -> CostModel:
    """`cost` with its context slopes timed (`SLOPE_WIDTHS` at each of the `long` contexts
    against its base, interleaved in rounds as `measure_costs`'s), up to `SLOPE_TRIES` times
    while they fit no slope at all: then `fitted` is False, and the next load times them
    again (a calibration beside two other servers loading fitted 0, 0 once, the file kept
    it, and at long context the policy was priced by its timed cycles alone for good). The
    model's spread: the rounds' (`_rounds`)."""
    target, context = pipeline.adapter, cost.base
    block = pipeline.drafter.args.block_size if pipeline.drafter is not None else 1
    ids = _context_ids(target, context)
    widths = [w for w in SLOPE_WIDTHS if w <= cost.max_width]
    deadline = time.perf_counter() + max(budget, 0.0)
    for attempt in range(SLOPE_TRIES):
        left = deadline - time.perf_counter()
        v_slope, d_slope, measured, spread = _measure_slopes(
            pipeline, widths, context, long, ids, block, max(reps - 1, 1),
            left / (SLOPE_TRIES - attempt))
        if not measured:
            return replace(cost, verify_slope=v_slope, draft_slope=d_slope, fitted=True)
        if sum(v_slope) > 0:
            return replace(cost, verify_slope=v_slope, draft_slope=d_slope, fitted=True,
                           spread=spread)
        # a longer context always costs more: timings that say otherwise had other work in them
        again = attempt + 1 < SLOPE_TRIES
        log.get(__name__).warning(
            "calibration: the long-context forwards timed no slower than the short ones (a "
            "busy machine?); " + ("timing them again" if again else
                                  "their cost is left to the timed cycles, and timed again "
                                  "next time"))
    return replace(cost, verify_slope=v_slope, draft_slope=d_slope, fitted=False,
                   spread=spread)


def _rounds(jobs: dict, reps: int, budget: float, desc: str) -> tuple[dict, float]:
    """Run every job (a callable returning the seconds it timed) once per round, after a
    warm-up round, until at least `reps` rounds agree within `SPREAD` (`round_spread`) or
    `budget` seconds have passed (at least two rounds, at most `MAX_ROUNDS`) -> ({job: its fastest
    round}, the rounds' spread)."""
    times: dict = {k: [] for k in jobs}
    for job in jobs.values():                          # warm-up: first-use compilation
        job()
    deadline = time.perf_counter() + budget
    bar = log.progress(None, desc, total=max(reps, 2), unit="round")
    spread = float("inf")
    try:
        for r in range(MAX_ROUNDS):
            for k, job in jobs.items():
                times[k].append(job())
            bar.total = max(bar.total, r + 1)
            bar.update(1)
            if r + 1 >= 2:
                spread = round_spread(times)
                bar.set_postfix_str(f"spread {100 * spread:.0f}%", refresh=False)
            if r + 1 >= 2 and (time.perf_counter() > deadline
                               or r + 1 >= reps and spread <= SPREAD):
                break
    finally:
        bar.close()
    return {k: min(v) for k, v in times.items()}, spread


def round_spread(times: dict) -> float:
    """How far the rounds disagree: per job, its second-fastest round over its fastest, less 1,
    and of those the median (a calibration prices by the fastest round, which one more round
    that agrees confirms; a stall in one job's rounds does not decide alone). Interleaved,
    load that holds through a whole round shows in every job's round alike."""
    gaps = sorted(sorted(v)[1] / sorted(v)[0] - 1.0 for v in times.values()
                  if len(v) >= 2 and min(v) > 0)
    return gaps[len(gaps) // 2] if gaps else 0.0


def _width_jobs(target, drafter, cache, dcache, anchor, feats, width: int, block: int,
                copy_cache: bool) -> dict:
    """{("draft", width): time the drafter's pass (widths 2 .. block, with a drafter),
    ("verify", width): time the verify}: each a callable returning the seconds of one forward
    from `cache`: a deep copy of it (copy_cache: a one-row step rotates a sliding window in
    place, which no rollback can undo), else rolled back (a long context is too big to copy
    each time)."""
    greedy = Sampling()

    def draft():
        t0 = time.perf_counter()
        p = drafter.propose(target, anchor, feats[:, :0], dcache, width, greedy,
                            mx.random.key(0))
        mx.eval(p.tokens)
        return time.perf_counter() - t0

    def verify():
        run = copy.deepcopy(cache) if copy_cache else cache
        snapshot = None if copy_cache else target.snapshot(run)
        t0 = time.perf_counter()
        mx.eval(target.forward(mx.repeat(anchor, width, axis=1), run))
        seconds = time.perf_counter() - t0
        if snapshot is not None:
            snapshot.rollback(0, width)
        return seconds

    jobs = {("draft", width): draft} if drafter is not None and 1 < width <= block else {}
    return {**jobs, ("verify", width): verify}


def _context_ids(target, context: int) -> mx.array:
    """The calibration's prompt [1, context]: fixed ids spread over the vocabulary."""
    return mx.array([[(17 * i) % target.vocab_size for i in range(context)]], dtype=mx.uint32)


def _time_chain(target, cache, anchor, steps: int = CHAIN_STEPS) -> float:
    """Seconds per plain step of a greedy chain of `steps` launched ahead, as
    `engine.Engine._launch_next` runs them (the next step's graph built and launched before the
    token before it is read; its first build unhidden, as a chain's is), from a copy of
    `cache`."""
    run = copy.deepcopy(cache)
    mx.eval([c.state for c in run])
    t0 = time.perf_counter()
    y = mx.argmax(target.forward(anchor, run)[0][:, -1], axis=-1)
    mx.async_eval(y)
    for _ in range(steps - 1):
        nxt = mx.argmax(target.forward(y.reshape(1, 1).astype(mx.uint32), run)[0][:, -1],
                        axis=-1)
        mx.async_eval(nxt)
        y.item()
        y = nxt
    y.item()
    return (time.perf_counter() - t0) / steps


def _measure_slopes(pipeline, widths, context, long, ids, block, reps, budget):
    """(verify_slope, draft_slope, measured, spread) from the widths timed at each long
    context against the same widths at `context`, every context in each round (`_rounds`);
    zeros, measured False and spread 0 where the target's caches cannot be grown
    (`grow_cache`), the target is pipeline-sharded (the other ranks' caches cannot be grown
    from here: they would fall out of step) or no long context is asked for."""
    target, drafter = pipeline.adapter, pipeline.drafter
    if not long or getattr(pipeline, "stage", None) is not None:
        return (0.0, 0.0), (0.0, 0.0), False, 0.0
    jobs = {}
    for n in (context, *long):
        cache = target.make_cache()
        _, feats = target.forward(ids, cache)
        if not grow_cache(cache, n - context):
            log.get(__name__).info("the target's cache is not a plain key/value store: its "
                                   "context cost is learnt from timed cycles only")
            return (0.0, 0.0), (0.0, 0.0), False, 0.0
        dcache = drafter.make_cache() if drafter is not None else None
        if drafter is not None:              # its context: n rows of (random) target features
            ctx = mx.concatenate([feats, mx.random.normal(
                (1, n - context, feats.shape[-1])).astype(feats.dtype)], axis=1)
            mx.eval(drafter.propose(target, ids[:, -1:], ctx, dcache, 2, Sampling(),
                                    mx.random.key(0)).tokens)
        for w in widths:
            jobs.update({(n, *k): job for k, job in _width_jobs(
                target, drafter, cache, dcache, ids[:, -1:], feats, w, block,
                copy_cache=False).items()})
    best, spread = _rounds(jobs, reps, budget, "calibration at long context")
    v_points = [(w, n - context, best[(n, "verify", w)] - best[(context, "verify", w)])
                for n in long for w in widths]
    d_points = [(w, n - context, best[(n, "draft", w)] - best[(context, "draft", w)])
                for n in long for w in widths if (n, "draft", w) in best]
    del jobs
    mx.clear_cache()
    return fit_slope(v_points), fit_slope(d_points), True, spread
