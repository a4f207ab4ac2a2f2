"""The constants of the width policy fitted on one machine (the project's 2-core x86-64 CPU,
the embedded SmolLM2 pair), not calibrated per machine: what, and the measurement behind each,
in docs/decisions.md ("The width policy in one package; its machine-fitted constants in one
table")."""

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
    # from `adaptive.LONG_BUCKET`, positions are offered up to this many times the deepest one
    # with evidence (`AdaptiveWidth.alphas`)
    untried_reach: int = 4
    # `AdaptiveWidth`: alpha_1 before any evidence, worth `prior_strength` tries; the weight of
    # older tries per try (~20 tries of memory)
    prior: float = 0.8
    prior_strength: float = 2.0
    decay: float = 0.95
    # probes' budget: the share of the time their extra cost may take while drafting is far from
    # paying (best rate under `far` x plain's), and while it nearly pays (`AdaptiveWidth._probe_gap`)
    far: float = 0.9
    probe_budget: tuple[float, float] = (0.01, 0.05)
    # the weight of older timings per batched step in the batch's shared `Correction`
    batch_decay: float = 0.9
    # drafting's best priced at this share of plain's rate or more earns one reference drafting
    # step at a context size no batched drafting step was timed at (`BatchAwareWidth._reference`)
    reference_worth: float = 0.5
    # from this many steps a chain of plain steps' mean step is what plain decoding costs (its
    # start, about a step unhidden, then weighs 1/8 or less; `planner.PlainStepTimer.long`)
    trusted_chain: int = 8


FIT = MachineFit()
