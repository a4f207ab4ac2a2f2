"""The bench's results: one system's run on one prompt (`Run`), the summary of a system over a
part's runs (`summarize`), speedups paired per prompt (`add_ratios`), and the parts of an
unfinished run worth keeping (`unfinished`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import log
from ..policy.acceptance import calibration
from ..policy.adaptive import DRAFTER, LOOKUP
from ..decode.stats import Cycle, GenerationStats

_log = log.get(__name__)


@dataclass
class Run:
    """One system on one prompt."""

    tokens: list[int]
    prefill_s: float
    decode_s: float
    peak_mb: float
    steps: list[Cycle] = field(default_factory=list)     # empty for plain mlx-lm


def _tps(run: Run) -> float:
    return max(len(run.tokens) - 1, 0) / run.decode_s if run.decode_s else 0.0


def summarize(runs: list[Run]) -> dict:
    """Decode tok/s over all runs (tokens after the first / decode seconds); tau, mean width,
    per-position acceptance and the calibration of the predicted acceptance
    (`policy.acceptance.calibration`) pooled over the runs' cycles, per source too; drafted
    rows the planner cut before verifying."""
    decode_tokens = sum(max(len(r.tokens) - 1, 0) for r in runs)
    decode_s = sum(r.decode_s for r in runs)
    pooled = GenerationStats(steps=[c for r in runs for c in r.steps])
    return {"decode_tps": decode_tokens / decode_s if decode_s else 0.0,
            "per_prompt_tps": [_tps(r) for r in runs],
            "tau": pooled.tau, "tau_drafter": pooled.source_tau(DRAFTER),
            "tau_lookup": pooled.source_tau(LOOKUP),
            "cycles_drafter": len(pooled.drafting(DRAFTER)),
            "cycles_lookup": len(pooled.drafting(LOOKUP)),
            "plain_steps": len(pooled.steps) - pooled.cycles,
            "mean_width": pooled.mean_width,
            "position_acceptance": pooled.position_acceptance(),
            "position_acceptance_drafter": pooled.position_acceptance(DRAFTER),
            "position_acceptance_lookup": pooled.position_acceptance(LOOKUP),
            # the predicted acceptance of each verified draft position against what happened
            "calibration_drafter": calibration(pooled.calibration_records(DRAFTER)),
            "calibration_lookup": calibration(pooled.calibration_records(LOOKUP)),
            "cut_rows": pooled.cut_rows,
            "prefill_s": float(np.mean([r.prefill_s for r in runs])),
            "peak_mb": float(max(r.peak_mb for r in runs)),
            "tokens": sum(len(r.tokens) for r in runs), "requests": len(runs)}


def _paired(a: list[float], b: list[float]) -> float:
    """Median over prompts of a_i / b_i: each prompt's runs follow each other, so load that
    comes and goes mostly cancels, and one stalled run cannot swing the figure."""
    return float(np.median([x / y for x, y in zip(a, b) if y > 0] or [0.0]))


def add_ratios(table: dict, baseline: str = "mlx-lm") -> dict:
    """`speedup` over `baseline` for every system, and `vs_reference` for each of ours with a
    reference run at the same block size; both paired per prompt (`_paired`)."""
    plain = table[baseline]["per_prompt_tps"]
    for name, row in table.items():
        row["speedup"] = _paired(row["per_prompt_tps"], plain)
        ref = table.get("reference " + name.split(" ", 1)[-1])
        if name.startswith(("dflash2-mlx", "hybrid")) and ref is not None:
            row["vs_reference"] = _paired(row["per_prompt_tps"], ref["per_prompt_tps"])
    return table


def parts_of(results: dict) -> list[tuple[str, dict]]:
    """(key, part) for every measured part ("<set> T=<t>"), in the order measured."""
    return [(k, v) for k, v in results.items() if k != "setup"]


def unfinished(out: Path) -> dict | None:
    """The results in `out/bench.json` when that run stopped before its last part, else None
    (no file, or a finished run: those are measured again, as asked)."""
    path = out / "bench.json"
    if not path.exists():
        return None
    try:
        results = json.loads(path.read_text())
        done = results["setup"].get("complete", True)    # files from before resuming: finished
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not the bench.json of a bench run ({type(e).__name__}: "
                         f"{e}); move it away or choose another --out") from None
    return None if done else results


def kept_parts(earlier: dict | None, setup: dict) -> dict:
    """The parts of `earlier` worth keeping: all of them when its setup is ours, else none."""
    if earlier is None:
        return {}
    theirs = {k: v for k, v in earlier["setup"].items() if k != "complete"}
    ours = {k: v for k, v in setup.items() if k != "complete"}
    kept = dict(parts_of(earlier))
    if theirs != ours:
        differ = sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k))
        _log.info(f"the unfinished run in --out had other settings ({', '.join(differ)}): "
                  f"its {len(kept)} part(s) are measured again")
        return {}
    _log.info(f"resuming an unfinished run: {len(kept)} part(s) kept as measured "
              f"({', '.join(kept) or 'none'}); delete its bench.json to start over")
    return kept
