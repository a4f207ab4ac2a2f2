"""Drafter configuration: parse DFlash / DFlash 2 `config.json` files and check them.

The published format (z-lab's DFlash / DFlash 2 checkpoints on the Hub) keeps the backbone at
the top level and the drafting keys in `dflash_config`; older checkpoints put some drafting
keys (e.g. `block_size`) at the top level, so drafting keys are read from `dflash_config`
first, then from the top level.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DFLASH = "DFlashDraftModel"
DFLASH2 = "DFlash2DraftModel"
LAYER_TYPES = ("full_attention", "sliding_attention")
_REQUIRED = object()

# DFlash 2 defaults for checkpoints that name the architecture but omit a key (the published
# DFlash 2 write-up's values).
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16,
                    "selector_rank": 256, "selector_top_k": 16}


class CheckpointError(ValueError):
    """A drafter checkpoint (config or weights) that cannot be used; the message names the file."""


@dataclass(frozen=True)
class DrafterArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960
    num_target_layers: int | None = None
    rope_theta: float = 1e6
    rope_scaling: dict[str, Any] | None = None
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    is_causal: bool = False
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    # DFlash 2 parts; 0 disables a part (plain DFlash has both at 0).
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    architecture: str = DFLASH

    @property
    def has_conv(self) -> bool:
        return self.conv_kernel_size > 0

    @property
    def has_selector(self) -> bool:
        return self.selector_top_k > 0

    @property
    def sliding_only(self) -> bool:
        """Every layer is sliding-window: the drafter never looks further back than the window."""
        return all(t == "sliding_attention" for t in self.layer_types)

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config.json") -> "DrafterArgs":
        """Build from a parsed config.json; `source` names the file in error messages."""
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{source}: expected a JSON object at the top level")
        dcfg = cfg.get("dflash_config") or {}
        if not isinstance(dcfg, dict):
            raise CheckpointError(f"{source}: 'dflash_config' must be an object")
        arch = _architecture(cfg, source)

        def get(key, default=_REQUIRED, drafting=False):
            if drafting and key in dcfg:
                return dcfg[key]
            if key in cfg:
                return cfg[key]
            if default is _REQUIRED:
                where = "'dflash_config' or the top level" if drafting else "the top level"
                raise CheckpointError(f"{source}: missing key '{key}' (looked in {where})")
            return default

        rope, rope_theta = _rope(cfg)
        n_layers = int(get("num_hidden_layers"))
        layer_types = tuple(cfg.get("layer_types") or ("full_attention",) * n_layers)
        hidden = int(get("hidden_size"))
        heads = int(get("num_attention_heads"))
        extra = {}
        for key in DFLASH2_DEFAULTS:
            default = DFLASH2_DEFAULTS[key] if arch == DFLASH2 else 0
            extra[key] = int(get(key, default, drafting=True))
        try:
            args = cls(
                hidden_size=hidden,
                num_hidden_layers=n_layers,
                num_attention_heads=heads,
                num_key_value_heads=int(get("num_key_value_heads", heads)),
                head_dim=int(get("head_dim", hidden // heads)),
                intermediate_size=int(get("intermediate_size")),
                vocab_size=int(get("vocab_size")),
                block_size=int(get("block_size", drafting=True)),
                target_layer_ids=tuple(int(i) for i in get("target_layer_ids", drafting=True)),
                mask_token_id=int(get("mask_token_id", drafting=True)),
                rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(get("max_position_embeddings", 40960)),
                num_target_layers=get("num_target_layers", None),
                rope_theta=float(rope_theta),
                rope_scaling=rope,
                layer_types=layer_types,
                sliding_window=cfg.get("sliding_window"),
                is_causal=bool(cfg.get("is_causal") or False),
                final_logit_softcapping=get("final_logit_softcapping", None, drafting=True),
                input_embedding_scale=float(get("input_embedding_scale", 1.0, drafting=True)),
                output_multiplier=float(get("output_multiplier", 1.0, drafting=True) or 1.0),
                architecture=arch,
                **extra,
            )
        except (TypeError, ValueError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{source}: bad value in config: {e}") from e
        args.check(source)
        return args

    @classmethod
    def from_file(cls, path: str | Path) -> "DrafterArgs":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise CheckpointError(f"{path}: no such file (a drafter folder needs config.json)")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: malformed JSON ({e})") from e
        return cls.from_dict(cfg, source=str(path))

    def check(self, source: str = "config.json") -> None:
        """Internal consistency (the target-dependent checks are in `check_against_target`)."""
        def bad(key, msg):
            raise CheckpointError(f"{source}: '{key}' {msg}")

        if self.block_size < 2:
            bad("block_size", f"must be >= 2, got {self.block_size}")
        if not self.target_layer_ids:
            bad("target_layer_ids", "must list at least one target layer")
        if len(self.layer_types) != self.num_hidden_layers:
            bad("layer_types", f"has {len(self.layer_types)} entries for "
                f"num_hidden_layers={self.num_hidden_layers}")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            bad("layer_types", f"has unsupported entries {unknown}; allowed: {list(LAYER_TYPES)}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            bad("sliding_window", "must be a positive integer when layer_types has "
                "sliding_attention")
        if self.num_attention_heads % self.num_key_value_heads:
            bad("num_key_value_heads", f"({self.num_key_value_heads}) must divide "
                f"num_attention_heads ({self.num_attention_heads})")
        if self.has_conv:
            if self.conv_group_size <= 0 or self.hidden_size % self.conv_group_size:
                bad("conv_group_size", f"({self.conv_group_size}) must divide hidden_size "
                    f"({self.hidden_size})")
        if self.has_selector:
            if self.selector_rank <= 0:
                bad("selector_rank", "must be positive when selector_top_k > 0")
            if self.selector_top_k > self.vocab_size:
                bad("selector_top_k", f"({self.selector_top_k}) exceeds vocab_size "
                    f"({self.vocab_size})")

    def check_against_target(self, hidden_size: int, vocab_size: int, num_layers: int,
                             source: str = "config.json", target: str = "the target") -> None:
        """The drafter must read this target's features and speak its vocabulary (`source`
        names the drafter's config, `target` the target, in the error)."""
        if self.hidden_size != hidden_size:
            raise CheckpointError(f"{source}: 'hidden_size' is {self.hidden_size} but "
                                  f"{target}'s hidden size is {hidden_size}")
        if self.vocab_size != vocab_size:
            raise CheckpointError(f"{source}: 'vocab_size' is {self.vocab_size} but "
                                  f"{target}'s vocabulary has {vocab_size} entries")
        outside = [i for i in self.target_layer_ids if not 0 <= i < num_layers]
        if outside:
            raise CheckpointError(f"{source}: 'target_layer_ids' {outside} are outside "
                                  f"{target}'s layers 0..{num_layers - 1}")
        if not 0 <= self.mask_token_id < vocab_size:
            raise CheckpointError(f"{source}: 'mask_token_id' {self.mask_token_id} is outside "
                                  f"{target}'s vocabulary 0..{vocab_size - 1}")

    def to_config(self) -> dict:
        """The published config.json layout (backbone top level, drafting keys in dflash_config)."""
        d = asdict(self)
        drafting = ["block_size", "target_layer_ids", "mask_token_id", "final_logit_softcapping",
                    "input_embedding_scale", "output_multiplier"]
        if self.architecture == DFLASH2 or self.has_conv or self.has_selector:
            drafting += list(DFLASH2_DEFAULTS)
        dcfg = {k: d.pop(k) for k in drafting}
        for k in DFLASH2_DEFAULTS:
            d.pop(k, None)
        dcfg["target_layer_ids"] = list(dcfg["target_layer_ids"])
        arch = d.pop("architecture")
        d["layer_types"] = list(d["layer_types"])
        if d["rope_scaling"] is None:
            d.pop("rope_scaling")
        return {"architectures": [arch], "model_type": "qwen3", **d, "dflash_config": dcfg}


def _architecture(cfg: dict, source: str) -> str:
    archs = cfg.get("architectures") or [DFLASH]
    arch = DFLASH2 if DFLASH2 in archs else DFLASH if DFLASH in archs else None
    if arch is None:
        raise CheckpointError(
            f"{source}: 'architectures' is {archs}; expected {DFLASH} or {DFLASH2}")
    return arch


def _rope(cfg: dict) -> tuple[dict | None, float]:
    """(rope scaling, or None for plain RoPE; rope theta) from a config."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or None
    rope_theta = cfg.get("rope_theta", (rope or {}).get("rope_theta", 1e6))
    if rope is not None and rope.get("rope_type", rope.get("type")) in (None, "default"):
        rope = None  # only carries rope_theta: plain RoPE
    return rope, rope_theta
