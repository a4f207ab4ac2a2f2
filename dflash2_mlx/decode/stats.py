"""The figures of one generation: each step's source, width and accepted drafts; the sources a
cycle drafts from, and acceptance counts per draft position."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

DRAFTER, LOOKUP, PLAIN = "drafter", "lookup", "plain"     # the sources of a cycle's drafts


class PositionCounts:
    """Tries and acceptances per draft position (k, 1-based, is tried when drafts 1..k-1 were
    accepted in a cycle of width > k); each try weighs the older ones by `decay`."""

    def __init__(self, positions: int, decay: float = 1.0):
        self.decay = decay
        self.hits, self.tries = [0.0] * positions, [0.0] * positions

    def update(self, width: int, accepted: int, first: int = 1) -> None:
        """A cycle of `width` rows accepted `accepted` drafts: positions `first` .. the first
        rejected one (at most width - 1) were tried."""
        for k in range(first, min(accepted + 1, width - 1, len(self.tries)) + 1):
            self.tries[k - 1] = self.tries[k - 1] * self.decay + 1
            self.hits[k - 1] = self.hits[k - 1] * self.decay + (k <= accepted)

    def rates(self) -> list[float | None]:
        """hits / tries per position; None for a position never tried."""
        return [h / t if t else None for h, t in zip(self.hits, self.tries)]


@dataclass(frozen=True)
class Cycle:
    source: str          # DRAFTER | LOOKUP | PLAIN
    width: int           # rows verified
    accepted: int        # drafts accepted (0 for a plain step)
    drafted: int = 0     # rows drafted (more than `width` where the planner cut the verify)
    predicted: tuple[float, ...] = ()    # predicted a_k of each drafted position


@dataclass
class GenerationStats:
    """Figures of one generation. Times in seconds; tau counts the bonus token. A drafting
    cycle is one whose drafts came from the drafter or the lookup; plain steps are the rest."""

    block_size: int | str = 0            # the width setting of this generation, or "auto"
    prompt_tokens: int = 0
    cached_tokens: int = 0               # prompt tokens whose caches were reused, not prefilled
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    steps: list[Cycle] = field(default_factory=list)     # every step after prefill

    def drafting(self, source: str | None = None) -> list[Cycle]:
        return [c for c in self.steps if c.source != PLAIN and source in (None, c.source)]

    @property
    def cycles(self) -> int:
        return len(self.drafting())

    @property
    def accepted(self) -> list[int]:
        return [c.accepted for c in self.drafting()]

    @property
    def widths(self) -> list[int]:
        return [c.width for c in self.drafting()]

    def source_tau(self, source: str | None = None) -> float | None:
        """Mean accepted drafts + 1 per drafting cycle of `source` (None: any); None if none."""
        cycles = self.drafting(source)
        return sum(c.accepted + 1 for c in cycles) / len(cycles) if cycles else None

    @property
    def tau(self) -> float:
        """Mean acceptance length over all drafting cycles (1.0: nothing was drafted)."""
        tau = self.source_tau()
        return 1.0 if tau is None else tau

    @property
    def mean_width(self) -> float:
        """Mean rows verified per step, plain steps included."""
        return sum(c.width for c in self.steps) / len(self.steps) if self.steps else 1.0

    @property
    def decode_tps(self) -> float:
        """Tokens per second after the first token (which prefill produces)."""
        return (self.generated_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    def position_acceptance(self, source: str | None = None) -> list[float | None]:
        """P(draft k accepted | drafts < k accepted), k = 1..widest - 1; None where untried."""
        cycles = self.drafting(source)
        counts = PositionCounts(max((c.width for c in cycles), default=1) - 1)
        for c in cycles:
            counts.update(c.width, c.accepted)
        return counts.rates()

    def calibration_records(self, source: str | None = None) -> list[tuple[int, float, bool]]:
        """(position k, predicted P(drafts 1..k accepted), whether they were) of every verified
        draft position with a prediction (`policy.acceptance.calibration` reads them)."""
        out = []
        for c in self.drafting(source):
            prefix = 1.0
            for k, a in enumerate(c.predicted[: c.width - 1], 1):
                prefix *= a
                out.append((k, prefix, k <= c.accepted))
        return out

    @property
    def cut_rows(self) -> int:
        """Drafted rows the planner did not verify."""
        return sum(max(c.drafted - c.width, 0) for c in self.steps)

    def copy(self) -> "GenerationStats":
        return replace(self, steps=list(self.steps))

    def to_dict(self) -> dict:
        cycles = self.drafting()
        return {
            "block_size": self.block_size, "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens, "generated_tokens": self.generated_tokens,
            "prefill_s": self.prefill_s, "decode_s": self.decode_s,
            "decode_tps": self.decode_tps, "steps": len(self.steps),
            "plain_steps": len(self.steps) - len(cycles), "cycles": len(cycles),
            "cycles_drafter": len(self.drafting(DRAFTER)),
            "cycles_lookup": len(self.drafting(LOOKUP)),
            "tau": self.tau, "tau_drafter": self.source_tau(DRAFTER),
            "tau_lookup": self.source_tau(LOOKUP), "mean_width": self.mean_width,
            "sources": [c.source for c in cycles], "widths": [c.width for c in cycles],
            "accepted_per_cycle": [c.accepted for c in cycles],
            "position_acceptance": self.position_acceptance(),
            "position_acceptance_drafter": self.position_acceptance(DRAFTER),
            "position_acceptance_lookup": self.position_acceptance(LOOKUP),
        }
