"""Adaptive runtime block size: pick each cycle the width with the most expected tokens/second.

With per-position acceptance rates alpha_k = P(draft k accepted | drafts < k accepted), a cycle
of width w commits on average E(w) = 1 + sum_{k<w} prod_{j<=k} alpha_j tokens and costs
C(w) = draft(w) + verify(w) seconds (w = 1: a plain decoding step, no draft). The policy picks
argmax_w E(w) / C(w). Costs are measured once per machine, model pair and precision, and cached,
then corrected by the cycles actually timed (a busy machine, a longer context, per-cycle
bookkeeping the calibration does not see): a width timed a few times costs what it took, one
not yet timed its calibration scaled by what the timed cycles took over theirs. The alphas are
running estimates: counts of the recent tries of each position (older tries decay), so a
change of content - code to chat - shows within tens of cycles. While the policy decodes
plainly (w = 1) nothing is learnt, so after `probe_every` such cycles it drafts one token to
notice when drafting pays again (3x more rarely while drafting looks far from paying: probes
cost a little each time).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx

from .sampling import Sampling


@dataclass(frozen=True)
class CycleCost:
    """Measured seconds per cycle piece, index w-1 for width w."""

    draft: tuple[float, ...]
    verify: tuple[float, ...]

    def cycle(self, width: int) -> float:
        return self.verify[width - 1] + (self.draft[width - 1] if width > 1 else 0.0)

    @property
    def max_width(self) -> int:
        return len(self.verify)


class AdaptiveWidth:
    """Chooses the block width of each cycle; `update` after each cycle with what was accepted.

    prior: alpha assumed for position 1 before any evidence (later positions: the estimate of
    the position before), worth `strength` tries; decay: weight
    of a position's older tries each time it is tried (0.95: about 20 tries of memory). The
    defaults were tuned in simulation (tests/test_adaptive.py): within 3% of the best fixed
    width on steady content, ahead of it when content alternates.
    """

    def __init__(self, cost: CycleCost, prior: float = 0.8, strength: float = 2.0,
                 decay: float = 0.95, probe_every: int = 8, far: float = 0.9, slow: int = 3):
        self.cost, self.decay, self.probe_every = cost, decay, probe_every
        self.far, self.slow = far, slow
        n = cost.max_width - 1
        self.prior_hits, self.prior_tries = prior * strength, strength
        self.hits, self.tries = [0.0] * n, [0.0] * n
        self.plain_run = 0                  # consecutive cycles the policy chose w = 1
        # timed cycles: decayed count and seconds per width; decayed seconds over calibrated
        # seconds of all timed cycles (how much slower than calibrated the machine runs now)
        self.timed, self.timed_s = [0.0] * cost.max_width, [0.0] * cost.max_width
        self.load_s = self.load_calibrated = 0.0

    def cycle_cost(self, width: int) -> float:
        """Expected seconds of a width-`width` cycle: the mean of its timed cycles once there
        are a few, else the calibration times the load factor of all timed cycles (on a busy
        machine the bare calibration made every untimed width look cheap, and the policy
        wandered through them one by one)."""
        if self.timed[width - 1] >= 3:
            return self.timed_s[width - 1] / self.timed[width - 1]
        load = self.load_s / self.load_calibrated if self.load_calibrated else 1.0
        return self.cost.cycle(width) * load

    def alphas(self) -> list[float]:
        """Estimated alpha_k, k = 1..max width - 1. Position 1 starts from `prior`; a later
        position starts from the estimate of the one before it, so positions that are rarely
        reached (drafting goes badly) do not keep an optimistic prior that has no evidence."""
        out, prior = [], self.prior_hits / self.prior_tries
        for h, t in zip(self.hits, self.tries):
            prior = (h + prior * self.prior_tries) / (t + self.prior_tries)
            out.append(prior)
        return out

    def expected_tokens(self, width: int) -> float:
        total, p = 1.0, 1.0
        for alpha in self.alphas()[: width - 1]:
            p *= alpha
            total += p
        return total

    def choose(self, limit: int | None = None) -> int:
        widths = range(1, min(limit or self.cost.max_width, self.cost.max_width) + 1)
        rate = {w: self.expected_tokens(w) / self.cycle_cost(w) for w in widths}
        best = max(widths, key=rate.get)
        if best == 1 and len(widths) > 1:
            self.plain_run += 1
            # probes cost: far from paying (drafting's best rate < `far` x plain's), probe
            # `slow` times more rarely
            gap = self.probe_every * (self.slow if max(rate[w] for w in widths[1:])
                                      < self.far * rate[1] else 1)
            if self.plain_run >= gap:
                self.plain_run = 0
                return 2
        else:
            self.plain_run = 0
        return best

    def update(self, width: int, accepted: int, seconds: float | None = None) -> None:
        """After a cycle of `width` that accepted `accepted` drafts (and took `seconds`)."""
        for k in range(1, min(accepted + 1, width - 1) + 1):   # positions tried this cycle
            self.tries[k - 1] = self.tries[k - 1] * self.decay + 1
            self.hits[k - 1] = self.hits[k - 1] * self.decay + (k <= accepted)
        if seconds is not None:
            # a one-off stall (first-use compilation, the OS) must not swamp the estimate
            seconds = min(seconds, 2.0 * self.cycle_cost(width))
            i = width - 1
            self.timed[i] = self.timed[i] * self.decay + 1
            self.timed_s[i] = self.timed_s[i] * self.decay + seconds
            self.load_s = self.load_s * self.decay + seconds
            self.load_calibrated = self.load_calibrated * self.decay + self.cost.cycle(width)


# --------------------------------------------------------------------------- calibration

CALIBRATION_VERSION = "2"     # bump when measure_costs changes: old entries are re-measured


def cache_file() -> Path:
    """`$DFLASH2_CACHE/calibration.json` (default cache: `~/.cache/dflash2-mlx`)."""
    from .assets import resolve_cache_dir

    return resolve_cache_dir() / "calibration.json"


def calibration_key(pipeline) -> str:
    d = pipeline.describe() if hasattr(pipeline, "describe") else {}
    vocab = pipeline.drafter.draft_vocab
    parts = [CALIBRATION_VERSION, platform.machine(), platform.processor(),
             str(mx.default_device()), mx.__version__,
             repr(sorted((k, str(v)) for k, v in d.items() if k != "block_size")),
             str(pipeline.adapter.num_layers), str(pipeline.adapter.hidden_size),
             str(pipeline.drafter.args), str(None if vocab is None else vocab.ids.size)]
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


def measure_costs(pipeline, context: int = 128, reps: int = 5) -> CycleCost:
    """Time the drafter and the verify forward at every width after a `context`-token prompt.
    Widths are timed round-robin (load that comes and goes hits them alike), medians fitted
    nondecreasing in the width."""
    target, drafter = pipeline.adapter, pipeline.drafter
    ids = mx.array([[(17 * i) % target.vocab_size for i in range(context)]], dtype=mx.uint32)
    cache, dcache = target.make_cache(), drafter.make_cache()
    _, feats = target.forward(ids, cache)
    mx.eval(feats, [c.state for c in cache])
    anchor, greedy = ids[:, -1:], Sampling()
    drafter.propose(target, anchor, feats, dcache, 2, greedy, mx.random.key(0))
    widths = range(1, drafter.args.block_size + 1)
    d_times: dict[int, list[float]] = {w: [] for w in widths}
    v_times: dict[int, list[float]] = {w: [] for w in widths}
    for rep in range(reps + 1):                            # round 0 warms up
        for width in widths:
            t0 = time.perf_counter()
            if width > 1:
                p = drafter.propose(target, anchor, feats[:, :0], dcache, width, greedy,
                                    mx.random.key(0))
                mx.eval(p.tokens)
            t1 = time.perf_counter()
            mx.eval(target.forward(mx.repeat(anchor, width, axis=1), cache))
            t2 = time.perf_counter()
            target.rollback(cache, {}, 0, width)
            if rep:
                d_times[width].append(t1 - t0)
                v_times[width].append(t2 - t1)
    draft = [0.0] + _monotone([statistics.median(d_times[w]) for w in widths[1:]])
    verify = _monotone([statistics.median(v_times[w]) for w in widths])
    return CycleCost(tuple(draft), tuple(verify))


def _cached_entry(table: dict, key: str, widths: int) -> CycleCost | None:
    """The entry of `key` when it is well formed (two lists of `widths` numbers), else None:
    a file edited by hand or written by another version is measured again, not trusted."""
    entry = table.get(key)
    if not isinstance(entry, dict):
        return None
    draft, verify = entry.get("draft"), entry.get("verify")
    ok = all(isinstance(xs, list) and len(xs) == widths and
             all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in xs)
             for xs in (draft, verify))
    return CycleCost(tuple(map(float, draft)), tuple(map(float, verify))) if ok else None


def _read_table(path: Path) -> dict:
    try:
        table = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return table if isinstance(table, dict) else {}


def load_or_measure_costs(pipeline, progress=None) -> CycleCost:
    """Costs from the per-machine cache, measured (a few seconds) on first use.

    The cache is keyed on the machine, MLX, the model pair and how it was loaded (dtypes,
    quantization, settings file and entry, verify mode, max_ctx). Concurrent processes each
    write a uniquely named temporary file and atomically replace the cache with it, after
    re-reading it, so neither truncates the other's file (the last writer's other entries win).
    """
    path, key = cache_file(), calibration_key(pipeline)
    widths = pipeline.drafter.args.block_size
    cost = _cached_entry(_read_table(path), key, widths)
    if cost is not None:
        return cost
    if progress:
        progress("measuring draft and verify cost per block width (once per machine, model "
                 "pair and settings) ...")
    cost = measure_costs(pipeline)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = _read_table(path)                       # others may have written meanwhile
    table[key] = asdict(cost)
    fd, tmp = tempfile.mkstemp(prefix="calibration.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return cost
