"""Export a trained drafter in the published layout (`config.json` + `model.safetensors`),
optionally quantized."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from ..model.drafter import Drafter
from ..loading.checkpoint import quantize_drafter, save_drafter


def export_drafter(drafter: Drafter, folder: str | Path, *, bits: int | None = None,
                   group_size: int = 64, dtype=mx.bfloat16, card: str | None = None) -> Path:
    """Write `config.json` + `model.safetensors` (+ `draft_vocab.json` when the drafter was
    trained with a restricted softmax, + `MODEL_CARD.md` when `card` is given).

    Unquantized: stored in `dtype` (BF16 like the published files). `bits` (4 or 8) quantizes a
    copy (linear layers and selector codebooks; norms and conv base kernels stay in full
    precision) and stores it with mlx-lm's "quantization" config key, which `load` reads back.
    The drafter passed in is left untouched.
    """
    out = drafter
    if bits is not None:
        out = Drafter(drafter.args)
        out.load_weights(list(tree_flatten(drafter.parameters())), strict=True)
        quantize_drafter(out, bits, group_size)
        mx.eval(out.parameters())
        out.draft_vocab = drafter.draft_vocab
    folder = save_drafter(out, folder, dtype)
    if card is not None:
        (Path(folder) / "MODEL_CARD.md").write_text(card)
    return Path(folder)


def folder_megabytes(folder: str | Path) -> float:
    return sum(p.stat().st_size for p in Path(folder).iterdir() if p.is_file()) / 1e6
