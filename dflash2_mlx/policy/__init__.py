"""Width policies: which source drafts each cycle and how many rows the target verifies.

`planner`: `Planner`, the one object the engine asks for every row's plan of a step and tells
what the step did; `adaptive`: one sequence's policies (`FixedWidth`, `AdaptiveWidth`) and
`LookupShadow`; `batch`: the batch-aware policy; `costs`: the cost model and its online
correction; `calibration`: timing the costs, and their per-machine cache; `fitted`: the
constants fitted on one machine.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..lazy import exports

# imported on first use: `doctor` reads the calibrations without importing MLX
__getattr__, __dir__ = exports(__name__, {"Planner": "planner"}, globals())


@runtime_checkable
class WidthPolicy(Protocol):
    """What the planner (`planner.Planner`) asks of a sequence's policy each cycle.
    available: the widest block each source ("drafter", "lookup") can draft now; match_n: the
    lookup's recurring suffix length (0: none); context: the tokens the target's cache holds
    (None: the calibration's short context)."""

    last: tuple[float, float]        # (expected tokens, draft seconds) of its latest choice

    def choose(self, available: dict[str, int], match_n: int = 0, context: int | None = None,
               launched: bool = False) -> tuple[str, int]:
        """(source, width) of this cycle: ("plain", 1) or a source and the rows to verify.
        launched: the cycle is a plain step launched last cycle (a probe waits)."""

    def update(self, source: str, width: int, accepted: int, seconds: float | None = None,
               match_n: int = 0, context: int | None = None, first: int = 1) -> None:
        """A cycle's outcome: drafts accepted, seconds (None: untimed, or a `LookupShadow`'s
        score); first: the first draft position to count."""

    def launch_next(self, choice: tuple[str, int], available: dict[str, int],
                    match_n: int = 0, context: int | None = None) -> bool:
        """Whether this plain step launches the next one before its token is read."""

    def next_plain(self, available: dict[str, int], context: int | None = None) -> bool:
        """Whether the next cycle will be a plain step."""
