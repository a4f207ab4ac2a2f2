"""Planning the split before any weight loads: which layers each rank runs (`plan_stages`,
`StagePlan`), read from the target's config, and the check that every rank is about to load
the same thing (`check_same_everywhere`)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..loading.gguf import read_gguf_header
from .link import Link, PipelineError


def parse_split(text: str | None) -> tuple[int, ...] | None:
    """'--pipeline-split 20,12' -> (20, 12); None -> None (even split)."""
    if text is None or text == "":
        return None
    try:
        parts = tuple(int(p) for p in str(text).split(","))
    except ValueError:
        raise ValueError(f"--pipeline-split {text!r}: expected layer counts per rank, "
                         "comma-separated, e.g. 20,12") from None
    return parts


def plan_stages(num_layers: int, size: int, split: tuple[int, ...] | None = None
                ) -> list[tuple[int, int]]:
    """[(start, end)] layer range of each rank; even by default (the low ranks get the extra
    layers). A split that does not fit (wrong count, a rank without layers, a sum other than
    the model's layer count) raises ValueError before anything loads."""
    if size > num_layers:
        raise ValueError(f"--pipeline: {size} ranks for a target of {num_layers} layers; each "
                         "rank needs at least one layer (use fewer hosts)")
    if split is None:
        base, extra = divmod(num_layers, size)
        split = tuple(base + (r < extra) for r in range(size))
    if len(split) != size or any(s < 1 for s in split) or sum(split) != num_layers:
        raise ValueError(f"--pipeline-split {','.join(map(str, split))}: expected {size} "
                         f"positive layer counts (one per rank) summing to the target's "
                         f"{num_layers} layers")
    bounds, start = [], 0
    for s in split:
        bounds.append((start, start + s))
        start += s
    return bounds


def target_shape(path: Path) -> tuple[int, int]:
    """(decoder layers, hidden size) of a target, from its config (mlx-lm folder) or metadata
    (GGUF), without reading any weight."""
    if path.suffix == ".gguf":
        meta = read_gguf_header(path)
        arch = meta.get("general.architecture")
        keys = (f"{arch}.block_count", f"{arch}.embedding_length")
        missing = [k for k in keys if k not in meta]
        if missing:
            raise ValueError(f"{path}: GGUF metadata has no '{missing[0]}'")
        return int(meta[keys[0]]), int(meta[keys[1]])
    config = json.loads((path / "config.json").read_text())
    for cfg in (config, config.get("text_config") or {}):
        if "num_hidden_layers" in cfg and "hidden_size" in cfg:
            return int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    raise ValueError(f"{path / 'config.json'}: no num_hidden_layers / hidden_size")


@dataclass(frozen=True)
class StagePlan:
    """Who runs what: `bounds[r]` = (start, end) layers of rank r; `layer_ids`: the drafter's
    feature layers (global indices, drafter order); `hidden_size`: the target's H."""

    rank: int
    size: int
    bounds: tuple[tuple[int, int], ...]
    layer_ids: tuple[int, ...]
    hidden_size: int

    @property
    def start(self) -> int:
        return self.bounds[self.rank][0]

    @property
    def end(self) -> int:
        return self.bounds[self.rank][1]

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def features_after(self, rank: int) -> list[int]:
        """Feature layers owned by ranks 1..rank, ascending: what rank's message carries."""
        hi = self.bounds[rank][1] if rank > 0 else self.bounds[0][0]
        return sorted(i for i in set(self.layer_ids) if self.bounds[0][1] <= i < hi)


def _digest(*parts) -> int:
    h = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


def config_text(path: Path | None) -> str:
    """What identifies a target or drafter without reading weights: its config files, or a
    GGUF's scalar metadata and size."""
    if path is None:
        return "none"
    if path.is_file():
        meta = read_gguf_header(path)
        return json.dumps(meta, sort_keys=True, default=str) + str(path.stat().st_size)
    files = [path / "config.json", path / "draft_vocab.json"]
    return "".join(f.read_text() for f in files if f.exists())


def check_same_everywhere(link: Link, facts: dict[str, tuple[str, str]]) -> None:
    """All ranks must run the same code on the same target, drafter, split and precision.
    facts: name -> (what is compared, what to show); digests are compared across ranks and the
    first difference is one error line (on every rank)."""
    from .. import __version__

    facts = {"dflash2-mlx version": (__version__, __version__), **facts}
    names = list(facts)
    table = link.agree([_digest(facts[n][0]) for n in names], "comparing what each rank loads")
    rows = table.tolist()
    for r, row in enumerate(rows[1:], start=1):
        for name, first, theirs in zip(names, rows[0], row):
            if first != theirs:
                mine = f"; rank {link.rank}: {facts[name][1]}" if link.rank in (0, r) else ""
                raise PipelineError(f"pipeline: rank {r} has a different {name} than rank 0"
                                    f"{mine}; start every rank with the same --model, --draft, "
                                    "--pipeline-split and precision flags")
