"""Width policies: which source drafts each cycle and how many rows the target verifies.

A cycle drafts from one source, the DFlash drafter or a lookup in the context
(`lookup.LookupIndex`), or none (width 1: a plain decoding step). `FixedWidth` is the trivial
policy. `AdaptiveWidth` picks each cycle the source and width with the most expected tokens
per second: with per-position acceptance rates alpha_k = P(draft k accepted | drafts < k
accepted) of a source, a cycle of width w commits on average E(w) = 1 + sum_{k<w} prod_{j<=k}
alpha_j tokens and costs C(w) = draft(w) + verify(w) seconds (a lookup drafts for free). Costs
are measured once per machine, model pair and precision, and cached, then corrected by the
cycles actually timed (a busy machine, a longer context, per-cycle bookkeeping the calibration
does not see): a (source, width) timed a few times costs what it took, one not yet timed its
calibration scaled by what the timed cycles took over theirs. The alphas are running
estimates per source: counts of the recent tries of each position (older tries decay), so a
change of content - code to chat - shows within tens of cycles. The lookup's proposals
that no cycle verified are scored against the tokens that committed (`ShadowLookup`), so its
estimates stay current for free; the drafter's cannot be, so while the policy decodes plainly,
after `probe_every` such cycles it drafts one token to notice when drafting pays again (3x more
rarely while drafting looks far from paying: probes cost a little each time).
"""

from __future__ import annotations

import copy
import hashlib
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx

from . import log
from .files import atomic_write
from .sampling import Sampling

_log = log.get(__name__)

DRAFTER, LOOKUP, PLAIN = "drafter", "lookup", "plain"     # the sources of a cycle's drafts
MATCH_BUCKETS = (1, 2, 3, 4, 8)     # lookup suffix lengths tracked apart: n, or the largest <= n


@dataclass(frozen=True)
class CycleCost:
    """Measured seconds per cycle piece, index w-1 for width w: the drafter's pass (widths up
    to its block size) and the target's verify (widths up to the widest any source drafts)."""

    draft: tuple[float, ...]
    verify: tuple[float, ...]

    def cycle(self, width: int, source: str = DRAFTER) -> float:
        draft = self.draft[width - 1] if source == DRAFTER and width > 1 else 0.0
        return self.verify[width - 1] + draft

    @property
    def max_width(self) -> int:
        return len(self.verify)


class PositionCounts:
    """Tries and acceptances of each draft position of one source. Position k (1-based) is
    tried in a cycle of width > k whose drafts 1..k-1 were all accepted; each try weighs the
    older ones by `decay` (1.0: plain counts)."""

    def __init__(self, positions: int, decay: float = 1.0):
        self.decay = decay
        self.hits, self.tries = [0.0] * positions, [0.0] * positions

    def update(self, width: int, accepted: int) -> None:
        for k in range(1, min(accepted + 1, width - 1, len(self.tries)) + 1):
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

    def choose(self, available: dict[str, int], match_n: int = 0) -> tuple[str, int]:
        """available: the widest block each source can draft this cycle (sources absent: none);
        match_n: the length of the lookup's recurring suffix (0: none)."""
        for source in (LOOKUP, DRAFTER):
            if self.width > 1 and available.get(source, 1) > 1:
                return source, min(self.width, available[source])
        return PLAIN, 1

    def next_plain(self, available: dict[str, int]) -> bool:
        """Whether the next cycle will surely be a plain step: only at width 1 (a fixed width
        drafts whenever a source can, the lookup included)."""
        return self.width == 1

    def update(self, source: str, width: int, accepted: int, seconds: float | None = None,
               match_n: int = 0) -> None:
        pass


class AdaptiveWidth:
    """Chooses each cycle's source and width; `update` after each cycle with what was accepted.

    widths: the widest block of each source (default: the drafter's, the calibrated width).
    prior: alpha assumed for position 1 before any evidence (later positions: the estimate of
    the position before), worth `strength` tries; decay: weight of a position's older tries
    each time it is tried (0.95: about 20 tries of memory). The defaults were tuned in
    simulation (tests/test_adaptive.py): within 3% of the best fixed width on steady content,
    ahead of it when content alternates.
    """

    def __init__(self, cost: CycleCost, widths: dict[str, int] | None = None,
                 prior: float = 0.8, strength: float = 2.0, decay: float = 0.95,
                 probe_every: int = 8, far: float = 0.9, slow: int = 3):
        self.cost, self.decay, self.probe_every = cost, decay, probe_every
        self.far, self.slow = far, slow
        self.widths = widths or {DRAFTER: cost.max_width}
        # acceptance counts per source; the lookup's per length of its recurring suffix (a
        # long match copies on for many tokens, a two-token one is often a common phrase)
        self.counts: dict[str, PositionCounts] = {}
        self.prior_hits, self.prior_tries = prior * strength, strength
        self.plain_run = 0                  # consecutive cycles the policy chose w = 1
        # timed cycles: decayed count and seconds per (source, width); decayed seconds over
        # calibrated seconds of all timed cycles (how much slower than calibrated it runs now)
        self.timed: dict[tuple[str, int], list[float]] = {}
        self.load_s = self.load_calibrated = 0.0

    def cycle_cost(self, width: int, source: str = DRAFTER) -> float:
        """Expected seconds of a cycle: the mean of its timed cycles once there are a few, else
        the calibration times the load factor of all timed cycles (on a busy machine the bare
        calibration made every untimed width look cheap, and the policy wandered through them
        one by one)."""
        source = PLAIN if width == 1 else source
        count, seconds = self.timed.get((source, width), (0.0, 0.0))
        if count >= 3:
            return seconds / count
        load = self.load_s / self.load_calibrated if self.load_calibrated else 1.0
        return self.cost.cycle(width, source) * load

    def counts_for(self, source: str, match_n: int = 0) -> PositionCounts:
        key = source if source != LOOKUP else \
            f"{LOOKUP}:{max([b for b in MATCH_BUCKETS if b <= match_n] or [0])}"
        if key not in self.counts:
            self.counts[key] = PositionCounts(self.widths[source] - 1, self.decay)
        return self.counts[key]

    def alphas(self, source: str = DRAFTER, match_n: int = 0) -> list[float]:
        """Estimated alpha_k of a source (the lookup's: for suffix matches of length
        `match_n`). Position 1 starts from `prior`; a later position starts from the estimate
        of the one before it, so positions that are rarely reached (drafting goes badly) do
        not keep an optimistic prior that has no evidence."""
        c = self.counts_for(source, match_n)
        out, prior = [], self.prior_hits / self.prior_tries
        for h, t in zip(c.hits, c.tries):
            prior = (h + prior * self.prior_tries) / (t + self.prior_tries)
            out.append(prior)
        return out

    def choose(self, available: dict[str, int] | None = None,
               match_n: int = 0) -> tuple[str, int]:
        """available: the widest block each source can draft this cycle (default: every source
        at its widest); match_n: the lookup's recurring suffix length -> (source, width);
        (PLAIN, 1) is always a choice."""
        rate = self._rates(dict(self.widths) if available is None else available, match_n)
        best = max(rate, key=rate.get)
        if best[1] > 1 or len(rate) == 1:
            self.plain_run = 0
            return best
        self.plain_run += 1
        if self.plain_run >= self._probe_gap(rate) and (DRAFTER, 2) in rate:
            self.plain_run = 0           # the lookup needs no probes: see ShadowLookup
            return DRAFTER, 2
        return best

    def next_plain(self, available: dict[str, int]) -> bool:
        """Whether the next cycle will be a plain step unless the lookup finds a match: plain
        is the best choice without it, and no drafter probe is due (nothing is changed)."""
        rate = self._rates({s: w for s, w in available.items() if s != LOOKUP}, 0)
        best = max(rate, key=rate.get)
        return best[1] == 1 and ((DRAFTER, 2) not in rate
                                 or self.plain_run + 1 < self._probe_gap(rate))

    def _rates(self, available: dict[str, int], match_n: int) -> dict[tuple[str, int], float]:
        """Expected tokens per second of each (source, width) on offer, plain included."""
        rate = {(PLAIN, 1): 1.0 / self.cycle_cost(1)}
        for source, most in available.items():
            tokens, p = 1.0, 1.0               # E(w), accumulated over the widths in turn
            for w, alpha in zip(range(2, min(most, self.widths[source]) + 1),
                                self.alphas(source, match_n)):
                p *= alpha
                tokens += p
                rate[(source, w)] = tokens / self.cycle_cost(w, source)
        return rate

    def _probe_gap(self, rate: dict) -> int:
        """Plain cycles between probes: `slow` times more while drafting is far from paying
        (its best rate < `far` x plain's), since probes cost a little each time."""
        far = max(r for c, r in rate.items() if c[1] > 1) < self.far * rate[(PLAIN, 1)]
        return self.probe_every * (self.slow if far else 1)

    def update(self, source: str, width: int, accepted: int, seconds: float | None = None,
               match_n: int = 0) -> None:
        """After a cycle of `width` drafted by `source` that accepted `accepted` drafts (and
        took `seconds`; `match_n` as given to `choose`)."""
        if width > 1:
            self.counts_for(source, match_n).update(width, accepted)
        if seconds is not None:
            source = PLAIN if width == 1 else source
            # a one-off stall (first-use compilation, the OS) must not swamp the estimate
            seconds = min(seconds, 2.0 * self.cycle_cost(width, source))
            count, total = self.timed.get((source, width), (0.0, 0.0))
            self.timed[(source, width)] = [count * self.decay + 1,
                                           total * self.decay + seconds]
            self.load_s = self.load_s * self.decay + seconds
            self.load_calibrated = (self.load_calibrated * self.decay
                                    + self.cost.cycle(width, source))


class ShadowLookup:
    """Learns the lookup's acceptance for free: a proposal that no cycle verified (the policy
    decoded plainly or drafted from the drafter) is scored against the tokens that did commit,
    and the policy is told what a lookup cycle would have accepted (`update` without seconds).
    Greedy, that is exactly the acceptance; sampling, a committed token equals the proposed one
    with probability p(token), the point-mass acceptance, so the estimate is unbiased. One
    proposal is followed at a time, as cycles would (no overlapping, correlated copies), so
    the lookup is never probed with a verify that costs time."""

    def __init__(self, policy):
        self.policy = policy
        self.open: tuple[list[int], int] | None = None     # (proposal, match_n)
        self.seen: list[int] = []                          # tokens committed since

    def offer(self, guess: list[int] | None, match_n: int) -> None:
        """A proposal this cycle does not verify (ignored while one is followed)."""
        if guess and self.open is None:
            self.open, self.seen = (list(guess), match_n), []

    def commit(self, new: list[int]) -> None:
        if self.open is None:
            return
        guess, match_n = self.open
        self.seen.extend(new)
        a = next((i for i, (g, t) in enumerate(zip(guess, self.seen)) if g != t), None)
        if a is None and len(self.seen) < len(guess):
            return                                         # all agree so far: keep following
        self.policy.update(LOOKUP, len(guess) + 1, len(guess) if a is None else a,
                           None, match_n)
        self.open = None


# --------------------------------------------------------------------------- calibration

CALIBRATION_VERSION = "3"     # bump when measure_costs changes: old entries are re-measured


def cache_file() -> Path:
    """`$DFLASH2_CACHE/calibration.json` (default cache: `~/.cache/dflash2-mlx`)."""
    from .assets import resolve_cache_dir

    return resolve_cache_dir() / "calibration.json"


def calibration_key(pipeline) -> str:
    d = pipeline.describe() if hasattr(pipeline, "describe") else {}
    drafter = pipeline.drafter
    vocab = drafter.draft_vocab if drafter is not None else None
    from . import blas

    parts = [CALIBRATION_VERSION, platform.machine(), platform.processor(),
             str(mx.default_device()), mx.__version__, blas.active().name,
             repr(sorted((k, str(v)) for k, v in d.items() if k != "block_size")),
             str(pipeline.adapter.num_layers), str(pipeline.adapter.hidden_size),
             str(drafter.args if drafter is not None else None),
             str(None if vocab is None else vocab.ids.size)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def _monotone(xs: list[float]) -> list[float]:
    """Least-squares nondecreasing fit (pool adjacent violators): a wider block never costs
    less, whatever the timing noise said."""
    blocks: list[list[float]] = []                 # [mean, count]
    for x in xs:
        blocks.append([x, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    return [m for m, n in blocks for _ in range(int(n))]


def measure_costs(pipeline, max_width: int, context: int = 128, reps: int = 3) -> CycleCost:
    """Time the drafter (widths up to its block size; none without a drafter) and the verify
    forward at every width up to `max_width`, after a `context`-token prompt. Widths are timed
    round-robin (load that comes and goes hits them alike), medians fitted nondecreasing in
    the width."""
    target, drafter = pipeline.adapter, pipeline.drafter
    ids = mx.array([[(17 * i) % target.vocab_size for i in range(context)]], dtype=mx.uint32)
    cache = target.make_cache()
    _, feats = target.forward(ids, cache)
    mx.eval(feats, [c.state for c in cache])
    anchor, greedy = ids[:, -1:], Sampling()
    block = drafter.args.block_size if drafter is not None else 1
    if drafter is not None:
        dcache = drafter.make_cache()
        drafter.propose(target, anchor, feats, dcache, 2, greedy, mx.random.key(0))
    widths = range(1, max(max_width, block) + 1)
    d_times: dict[int, list[float]] = {w: [] for w in widths}
    v_times: dict[int, list[float]] = {w: [] for w in widths}
    for rep in log.progress(range(reps + 1), "calibration", unit="round"):   # 0 warms up
        for width in widths:
            t0 = time.perf_counter()
            if 1 < width <= block:
                p = drafter.propose(target, anchor, feats[:, :0], dcache, width, greedy,
                                    mx.random.key(0))
                mx.eval(p.tokens)
            # each forward starts from the prompt's cache: a one-row step rotates a sliding
            # window in place, which no rollback can undo
            run = copy.deepcopy(cache)
            t1 = time.perf_counter()
            mx.eval(target.forward(mx.repeat(anchor, width, axis=1), run))
            t2 = time.perf_counter()
            if rep:
                d_times[width].append(t1 - t0)
                v_times[width].append(t2 - t1)
    draft = [0.0] + _monotone([statistics.median(d_times[w]) for w in range(2, block + 1)])
    verify = _monotone([statistics.median(v_times[w]) for w in widths])
    return CycleCost(tuple(draft), tuple(verify))


def _cached_entry(table: dict, key: str, draft_widths: int,
                  verify_widths: int) -> CycleCost | None:
    """The entry of `key` when it is well formed (lists of `draft_widths` and `verify_widths`
    numbers), else None: a file edited by hand or written by another version is measured
    again, not trusted."""
    entry = table.get(key)
    if not isinstance(entry, dict):
        return None
    draft, verify = entry.get("draft"), entry.get("verify")
    ok = all(isinstance(xs, list) and len(xs) == n and
             all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in xs)
             for xs, n in ((draft, draft_widths), (verify, verify_widths)))
    return CycleCost(tuple(map(float, draft)), tuple(map(float, verify))) if ok else None


def _read_table(path: Path) -> dict:
    try:
        table = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return table if isinstance(table, dict) else {}


def load_or_measure_costs(pipeline, max_width: int) -> CycleCost:
    """Costs from the per-machine cache, measured (a few seconds) on first use; verify costs
    up to `max_width` rows (or the drafter's block size, if wider).

    The cache is keyed on the machine, MLX, the model pair and how it was loaded (dtypes,
    quantization, settings file and entry, verify mode, max_ctx). Concurrent processes each
    replace the cache atomically (`files.atomic_write`) after re-reading it, so neither
    truncates the other's file (the last writer's other entries win).
    """
    path, key = cache_file(), calibration_key(pipeline)
    block = pipeline.drafter.args.block_size if pipeline.drafter is not None else 1
    cost = _cached_entry(_read_table(path), key, block, max(max_width, block))
    if cost is not None:
        return cost
    _log.info("measuring draft and verify cost per block width (once per machine, model pair "
              "and settings) ...")
    cost = measure_costs(pipeline, max_width)
    table = _read_table(path)                       # others may have written meanwhile
    table[key] = asdict(cost)
    with atomic_write(path) as f:
        json.dump(table, f, indent=1)
    return cost
