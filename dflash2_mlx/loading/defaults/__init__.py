"""The embedded default pair: SmolLM2-135M-Instruct (fetched once from PyPI, see `assets`) and
the DFlash 2 drafter trained for it by `dflash2-mlx train`, shipped in this folder
(`config.json` + `model.safetensors`, 4-bit; `draft_vocab.json`, the ids its softmax was
trained on; `MODEL_CARD.md` says how it was made).

Kept free of MLX imports: `default_pair()` only resolves paths.
"""

from __future__ import annotations

from pathlib import Path

DRAFTER_DIR = Path(__file__).resolve().parent


def drafter_path() -> Path:
    """The shipped drafter folder (published DFlash 2 layout)."""
    if not (DRAFTER_DIR / "config.json").is_file():
        raise FileNotFoundError(f"{DRAFTER_DIR}: the shipped drafter is missing (no config.json);"
                                " reinstall dflash2-mlx or pass a drafter explicitly")
    return DRAFTER_DIR


def default_pair(cache_dir: str | Path | None = None) -> tuple[Path, Path]:
    """(target .gguf path, drafter folder) of the embedded default. The target is downloaded
    into the package cache on first use (logged), then read from there."""
    from ..assets import smollm2_gguf

    drafter = drafter_path()
    return smollm2_gguf(cache_dir), drafter


__all__ = ["default_pair", "drafter_path", "DRAFTER_DIR"]
