"""A vision-language target's image side, loaded with mlx-vlm (`model.vision.Vision`).

The text model is mlx-lm's, loaded as for any target (`checkpoint.load_target`: mlx-lm drops
the vision weights), so text-only requests run exactly as on the text model. mlx-vlm's model
is then loaded lazily from the same folder; its language model is given the target's own
arrays wherever the names and shapes agree (nothing is copied), and only its tower, projector
and what its embedding merge reads are ever evaluated.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .. import log
from ..model.memory import activation_dtype
from ..model.vision import Vision

_log = log.get(__name__)

INSTALL = "pip install 'dflash2-mlx[vision]'"


def is_vision_config(config: dict) -> bool:
    return isinstance(config.get("vision_config"), dict)


def load_vision(path: Path, target: nn.Module, dtype=None) -> Vision | None:
    """The image side of the target at `path`, or None for a text-only target. A vision-
    language target whose images cannot be served loads text-only, saying why (no mlx-vlm,
    a family mlx-vlm does not know); `Vision.refusal` says why a known family's images are
    refused."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    if not is_vision_config(config):
        return None
    family = config.get("model_type", "?")
    try:
        from mlx_vlm.utils import get_model_and_args, load_model, load_processor
    except ImportError:
        log.notice(f"target {path}: a vision-language model ({family}); images need mlx-vlm "
                   f"({INSTALL}); text-only requests are served")
        return None
    try:
        get_model_and_args(config)
    except ValueError as e:
        log.notice(f"target {path}: mlx-vlm does not know the {family} family ({e}); "
                   "text-only requests are served")
        return None
    _log.info(f"loading the vision tower of {path} ({family}) with mlx-vlm ...")
    vlm = load_model(Path(path), lazy=True)
    processor = load_processor(Path(path), add_detokenizer=False)
    shared = share_language_model(vlm, target)
    _log.debug(f"vision: {shared} language-model arrays shared with the target")
    tower = {k: v for k, v in tree_flatten(vlm.parameters())
             if not k.startswith("language_model.")}
    if dtype is not None:
        tower = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
                 for k, v in tower.items()}
        vlm.update(tree_unflatten(list(tower.items())))
    mx.eval(list(tower.values()))
    vlm.eval()
    vision = Vision(vlm, processor, family, config, activation_dtype(target))
    if vision.refusal is not None:
        log.notice(f"target {path}: images on {family} targets are not served "
                   f"({vision.refusal}); text-only requests are")
    return vision


def share_language_model(vlm: nn.Module, target: nn.Module) -> int:
    """Point mlx-vlm's language model at the target's arrays where a parameter has the same
    name (under `language_model.`, or the target's own name) and shape -> how many."""
    mine = dict(tree_flatten(target.parameters()))
    theirs = [(k, v) for k, v in tree_flatten(vlm.parameters())
              if k.startswith("language_model.")]
    swap = []
    for k, v in theirs:
        for name in (k, k.removeprefix("language_model.")):
            a = mine.get(name)
            if a is not None and a.shape == v.shape:
                swap.append((k, a))
                break
    if swap:
        vlm.update(tree_unflatten(swap))
    return len(swap)

