"""Adaptive runtime block size: pick each cycle the width with the most expected tokens/second.

With per-position acceptance rates alpha_k = P(draft k accepted | drafts < k accepted), a cycle
of width w commits on average E(w) = 1 + sum_{k<w} prod_{j<=k} alpha_j tokens and costs
C(w) = draft(w) + verify(w) seconds (w = 1: a plain decoding step, no draft). The policy picks
argmax_w E(w) / C(w). Costs are measured once per machine, model pair and precision, and cached;
the alphas are running estimates: counts of the recent tries of each position (older tries
decay), so a change of content - code to chat - shows within tens of cycles. While the policy
decodes plainly (w = 1) nothing is learnt, so every `probe_every`-th such cycle drafts one token
to notice when drafting pays again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
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

    prior: alpha assumed for a position with no evidence, worth `strength` tries; decay: weight
    of a position's older tries each time it is tried (0.95: about 20 tries of memory). The
    defaults were tuned in simulation (tests/test_adaptive.py): within 3% of the best fixed
    width on steady content, ahead of it when content alternates.
    """

    def __init__(self, cost: CycleCost, prior: float = 0.8, strength: float = 1.0,
                 decay: float = 0.95, probe_every: int = 8):
        self.cost, self.decay, self.probe_every = cost, decay, probe_every
        n = cost.max_width - 1
        self.prior_hits, self.prior_tries = prior * strength, strength
        self.hits, self.tries = [0.0] * n, [0.0] * n
        self.plain_run = 0                  # consecutive cycles the policy chose w = 1

    def alphas(self) -> list[float]:
        return [(h + self.prior_hits) / (t + self.prior_tries)
                for h, t in zip(self.hits, self.tries)]

    def expected_tokens(self, width: int) -> float:
        total, p = 1.0, 1.0
        for alpha in self.alphas()[: width - 1]:
            p *= alpha
            total += p
        return total

    def choose(self, limit: int | None = None) -> int:
        widths = range(1, min(limit or self.cost.max_width, self.cost.max_width) + 1)
        best = max(widths, key=lambda w: self.expected_tokens(w) / self.cost.cycle(w))
        if best == 1 and len(widths) > 1:
            self.plain_run += 1
            if self.plain_run % self.probe_every == 0:
                return 2
        else:
            self.plain_run = 0
        return best

    def update(self, width: int, accepted: int) -> None:
        for k in range(1, min(accepted + 1, width - 1) + 1):   # positions tried this cycle
            self.tries[k - 1] = self.tries[k - 1] * self.decay + 1
            self.hits[k - 1] = self.hits[k - 1] * self.decay + (k <= accepted)


# --------------------------------------------------------------------------- calibration

def cache_file() -> Path:
    base = Path(os.environ.get("DFLASH2_CACHE", Path.home() / ".cache" / "dflash2-mlx"))
    return base / "calibration.json"


def calibration_key(pipeline) -> str:
    d = pipeline.describe() if hasattr(pipeline, "describe") else {}
    parts = [platform.machine(), platform.processor(), str(mx.default_device()), mx.__version__,
             repr(sorted((k, str(v)) for k, v in d.items() if k != "block_size")),
             str(pipeline.adapter.num_layers), str(pipeline.adapter.hidden_size),
             str(pipeline.drafter.args)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def measure_costs(pipeline, context: int = 128, reps: int = 3) -> CycleCost:
    """Time the drafter and the verify forward at every width after a `context`-token prompt."""
    target, drafter = pipeline.adapter, pipeline.drafter
    ids = mx.array([[(17 * i) % target.vocab_size for i in range(context)]], dtype=mx.uint32)
    cache, dcache = target.make_cache(), drafter.make_cache()
    _, feats = target.forward(ids, cache)
    mx.eval(feats, [c.state for c in cache])
    anchor, greedy = ids[:, -1:], Sampling()
    drafter.propose(target, anchor, feats, dcache, 2, greedy, mx.random.key(0))
    draft, verify = [], []
    for width in range(1, drafter.args.block_size + 1):
        d_times, v_times = [], []
        for _ in range(reps + 1):                          # the first run warms up
            t0 = time.perf_counter()
            if width > 1:
                p = drafter.propose(target, anchor, feats[:, :0], dcache, width, greedy,
                                    mx.random.key(0))
                mx.eval(p.tokens)
            t1 = time.perf_counter()
            mx.eval(target.forward(mx.repeat(anchor, width, axis=1), cache))
            t2 = time.perf_counter()
            target.rollback(cache, {}, 0, width)
            d_times.append(t1 - t0)
            v_times.append(t2 - t1)
        draft.append(statistics.median(d_times[1:]) if width > 1 else 0.0)
        verify.append(statistics.median(v_times[1:]))
    return CycleCost(tuple(draft), tuple(verify))


def load_or_measure_costs(pipeline, progress=None) -> CycleCost:
    """Costs from the per-machine cache, measured (a few seconds) on first use."""
    path, key = cache_file(), calibration_key(pipeline)
    try:
        table = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        table = {}
    entry = table.get(key)
    if entry and len(entry.get("verify", ())) == pipeline.drafter.args.block_size:
        return CycleCost(tuple(entry["draft"]), tuple(entry["verify"]))
    if progress:
        progress("measuring draft and verify cost per block width (once per machine and "
                 "model pair) ...")
    cost = measure_costs(pipeline)
    table[key] = asdict(cost)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, indent=1))
    tmp.replace(path)
    return cost
