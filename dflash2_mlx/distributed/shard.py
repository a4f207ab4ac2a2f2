"""Building a rank's share of the target: plan and agree before any weight loads (`prepare`),
then keep only this rank's weights of the lazily loaded model and make its stage (`build`)."""

from __future__ import annotations

import atexit
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from ..model.views import KVQuant, TargetModel, check_kv, find_stack_path
from .link import DEFAULT_TIMEOUT, Link
from .plan import (StagePlan, check_same_everywhere, config_text, parse_split, plan_stages,
                   target_shape)
from .stages import Follower, FollowerTarget, ShardedTarget, Stage

# Decoder stacks whose forward we know runs a layer range correctly: masks come from
# `cache[0]` or from the index attributes `views.INDEX_ATTRS`, recomputed for the range. Keyed
# by the mlx-lm module (mistral loads as llama; GGUF targets are llama).
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_5", "qwen3_next")


def check_family(model: nn.Module, source: str = "target") -> None:
    family = type(model).__module__.rsplit(".", 1)[-1]
    if family not in FAMILIES:
        raise ValueError(f"--pipeline: {source} is a '{family}' model; pipeline sharding "
                         f"supports {', '.join(FAMILIES)} (and llama GGUF files)")


def prepare(group, target_path: Path, draft_dir: Path | None, split: str | tuple | None,
            precision: str, timeout: float = DEFAULT_TIMEOUT) -> tuple[StagePlan, Link]:
    """Before any weight loads: plan the split from the target's config and check that every
    rank is about to load the same target, drafter, split and precision."""
    from ..model.config import DrafterArgs

    split = parse_split(split) if isinstance(split, (str, type(None))) else tuple(split)
    num_layers, hidden = target_shape(target_path)
    bounds = tuple(plan_stages(num_layers, group.size(), split))
    layer_ids = DrafterArgs.from_file(draft_dir).target_layer_ids if draft_dir else ()
    link = Link(group, timeout)
    check_same_everywhere(link, {
        "target": (config_text(target_path), str(target_path)),
        "drafter": (config_text(draft_dir), str(draft_dir)),
        "split": (str(bounds), ",".join(str(e - s) for s, e in bounds)),
        "precision": (precision, precision)})
    return StagePlan(group.rank(), group.size(), bounds, tuple(layer_ids), hidden), link


def keep_only_stage(model: nn.Module, plan: StagePlan) -> int:
    """Replace, in `model` itself, the parameters this rank does not run by empty arrays (other
    ranks' layers; on ranks > 0 also the embedding, final norm and head), then read the rest
    -> bytes of weights kept.

    This changes the model object (`Pipeline.target` on a pipeline rank holds only its share):
    the modules stay, so the cache types still come from them, and nothing can bring the
    dropped weights back by accident. mlx-lm's classes are not touched."""
    path = find_stack_path(model)
    prefix = ".".join(path + ("layers",)) + "."

    def needed(name: str) -> bool:
        if name.startswith(prefix):
            return plan.start <= int(name[len(prefix):].split(".", 1)[0]) < plan.end
        return plan.leader

    model.update(tree_map_with_path(
        lambda name, v: v if needed(name) else mx.zeros((0,), v.dtype), model.parameters()))
    kept = [v for n, v in tree_flatten(model.parameters()) if needed(n)]
    mx.eval(kept)
    return sum(v.nbytes for v in kept)


def build(model: nn.Module, plan: StagePlan, link: Link, kv: KVQuant | None = None) -> Stage:
    """This rank's stage of a lazily loaded target: keep (and read) only its weights, wait
    until every rank has loaded its own (loading may take minutes: a longer bound). kv: every
    rank's full-attention caches quantized (checked on the whole model, lazily)."""
    check_family(model)
    whole = TargetModel(model, kv)             # its shapes, read before the embedding empties
    if kv is not None:
        check_kv(model, kv)
    shape = (whole.hidden_size, whole.vocab_size, whole.num_layers)
    kept = keep_only_stage(model, plan)
    sizes = link.agree([kept // 1024], "waiting for every rank to load its layers",
                       timeout=max(10 * link.timeout, 600.0))
    if plan.leader:
        stage = Stage(plan, link, target=ShardedTarget(model, plan, link, kv))
        atexit.register(stage.close)
    else:
        stage = Stage(plan, link, follower=Follower(model, plan, link, kv))
        stage.target = FollowerTarget(stage, *shape)
    stage.weight_mib = [round(v / 1024, 1) for v in sizes[:, 0].tolist()]
    return stage
