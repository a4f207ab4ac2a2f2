"""The constants of the width policy fitted on one machine (the project's 2-core x86-64 CPU,
the embedded SmolLM2 pair), not calibrated per machine: what, and the measurement behind each,
in docs/decisions.md ("The width policy's machine-fitted constants")."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MachineFit:
    # each drafting sequence of a batched step beyond the dearest adds this share of its drafter
    # pass alone to the step's one pass (`costs.drafter_pass`)
    batch_draft_share: float = 0.5
    # what restarting a chain of plain steps launched ahead costs, in plain steps: its first
    # step's graph build runs unhidden (`costs.probe_steps`)
    relaunch: float = 0.5
    # from `adaptive.LONG_BUCKET`, the most tries the lookup evidence of other sequences weighs
    # beside a sequence's own (`AdaptiveWidth._evidence`)
    carry: float = 1.0


FIT = MachineFit()
