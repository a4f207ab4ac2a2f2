"""Width policies: which source drafts each cycle and how many rows the target verifies.

The protocol every policy follows is `decode.sequence.WidthPolicy` (a sequence holds one).
`planner`: `Planner`, the one object the engine asks for every row's plan of a step and tells
what the step did; `adaptive`: one sequence's policies (`FixedWidth`, `AdaptiveWidth`) and
`LookupShadow`; `batch`: the batch-aware policy; `costs`: the cost model and its online
correction; `calibration`: timing the costs, and their per-machine cache; `fitted`: the
constants fitted on one machine.
"""

from __future__ import annotations

from ..lazy import exports

# imported on first use: `doctor` reads the calibrations without importing MLX
__getattr__, __dir__ = exports(__name__, {"Planner": "planner"}, globals())
