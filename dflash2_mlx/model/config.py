"""Drafter configuration: parse DFlash / DFlash 2 / DSpark `config.json` files and check them.

The published DFlash format (z-lab's DFlash / DFlash 2 checkpoints on the Hub) keeps the
backbone at the top level and the drafting keys in `dflash_config`; older checkpoints put some
drafting keys (e.g. `block_size`) at the top level, so drafting keys are read from
`dflash_config` first, then from the top level.

DSpark drafters add a Markov head (`markov_rank`) and a confidence head
(`enable_confidence_head`, `confidence_head_with_markov`), and predict from block slot
`logits_start` on (0: the anchor's own row predicts the first draft). DeepSpec's own packaging
(an architecture naming DSpark, e.g. `Qwen3DSparkModel`) keeps every key at the top level; the
others are read into that schema first (`deepspec_schema`): vLLM speculators (the backbone under
`transformer_layer_config`, taps in `aux_hidden_state_layer_ids`, the first slot from
`speculative_tokens`), SpecForge (`dflash_config.projector_type: "dspark"`) and LiquidAI's (a
nested `dflash_config` without that tag). DFlash-lineage heads (NVIDIA's) say a causal block
(`dflash_query_causal`), a sliding window and attention sinks (`attention_sink_bias`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DFLASH = "DFlashDraftModel"
DFLASH2 = "DFlash2DraftModel"
DSPARK = "DSpark"            # our name for the kind; DeepSpec names e.g. "Qwen3DSparkModel"
LAYER_TYPES = ("full_attention", "sliding_attention")
_REQUIRED = object()

# DFlash 2 defaults for checkpoints that name the architecture but omit a key (the published
# DFlash 2 write-up's values).
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16,
                    "selector_rank": 256, "selector_top_k": 16}
# DeepSpec's defaults for a DSpark config that omits a key (as its trainer writes them).
DSPARK_DEFAULTS = {"markov_rank": 256, "enable_confidence_head": True,
                   "confidence_head_with_markov": True, "num_key_value_heads": 8}


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
    # DSpark parts (DFlash: logits_start 1, no heads, the target's embedding and head).
    logits_start: int = 1           # the block slot of the first prediction (0: the anchor's)
    markov_rank: int = 0            # 0: no Markov head
    confidence_head: bool = False
    confidence_with_markov: bool = False   # the confidence head also reads markov_w1[prev]
    attention_bias: bool = False
    rope_traditional: bool = False
    own_embed: bool = False         # its own `embed_tokens` (else the target's embedding)
    own_head: bool = False          # its own `lm_head` (else the target's head)
    attention_sinks: bool = False   # a learned sink logit per head (`attention_sink_bias`)
    draft_vocab_size: int | None = None   # its head's rows, mapped by the `d2t` tensor
    # a qwen3_5-flavoured backbone: q_proj also emits a gate on the attention's output, norm
    # weights are stored as offsets from one, rope turns the first `rope_dims` of a head only
    gated_q: bool = False
    norm_offset: bool = False
    rope_dims: int | None = None
    # "gemma4": Gemma 4's layer (sandwich norms scaled by `layer_scalar`, a GELU MLP, an
    # unscaled v norm, attention scale 1, its embedding times sqrt(hidden)); k_eq_v: its
    # values are the normed keys (no v_proj)
    backbone: str = "qwen3"
    k_eq_v: bool = False

    @property
    def has_conv(self) -> bool:
        return self.conv_kernel_size > 0

    @property
    def has_selector(self) -> bool:
        return self.selector_top_k > 0

    @property
    def is_dspark(self) -> bool:
        return self.architecture == DSPARK

    @property
    def max_drafts(self) -> int:
        """The most tokens one block drafts: the slots from `logits_start` on."""
        return self.block_size - self.logits_start

    @property
    def max_width(self) -> int:
        """The widest verify one block feeds: the anchor and `max_drafts` drafts."""
        return self.max_drafts + 1

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
        cfg, packaging = deepspec_schema(cfg, source)
        arch = DSPARK if packaging else _architecture(cfg, source)

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
        hidden = int(get("hidden_size"))
        heads = int(get("num_attention_heads"))
        fields = dict(
            rope_scaling=rope, rope_theta=rope_theta, is_causal=bool(cfg.get("is_causal")),
            layer_types=tuple(cfg.get("layer_types") or ("full_attention",) * n_layers),
            sliding_window=cfg.get("sliding_window"),
            num_key_value_heads=get("num_key_value_heads", heads),
            **{k: int(get(k, DFLASH2_DEFAULTS[k] if arch == DFLASH2 else 0, drafting=True))
               for k in DFLASH2_DEFAULTS})
        if arch == DSPARK:
            cfg, dspark = _dspark_fields(cfg, dcfg, packaging, n_layers, hidden // heads)
            fields.update(dspark)
        try:
            fields.update(
                hidden_size=hidden,
                num_hidden_layers=n_layers,
                num_attention_heads=heads,
                head_dim=int(get("head_dim", hidden // heads)),
                intermediate_size=int(get("intermediate_size")),
                vocab_size=int(get("vocab_size")),
                block_size=int(get("block_size", drafting=True)),
                target_layer_ids=tuple(int(i) for i in get("target_layer_ids", drafting=True)),
                mask_token_id=int(get("mask_token_id", drafting=True)),
                rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(get("max_position_embeddings", 40960)),
                num_target_layers=get("num_target_layers", None),
                final_logit_softcapping=get("final_logit_softcapping", None, drafting=True),
                input_embedding_scale=float(get("input_embedding_scale", 1.0, drafting=True)),
                output_multiplier=float(get("output_multiplier", 1.0, drafting=True) or 1.0),
                architecture=arch)
            fields.update(rope_theta=float(fields["rope_theta"]),
                          num_key_value_heads=int(fields["num_key_value_heads"]))
            args = cls(**fields)
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
        if not 0 <= self.logits_start < self.block_size:
            bad("logits_start", f"must be a block slot 0..{self.block_size - 1}, got "
                f"{self.logits_start}")
        if self.markov_rank < 0:
            bad("markov_rank", f"must be >= 0, got {self.markov_rank}")
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size < self.vocab_size:
            bad("draft_vocab_size", f"must be below vocab_size ({self.vocab_size}), got "
                f"{self.draft_vocab_size}")
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
        """The published config.json layout: z-lab's for DFlash (backbone top level, drafting
        keys in dflash_config), DeepSpec's for DSpark (every key top level)."""
        if self.is_dspark:
            return self._dspark_config()
        d = asdict(self)
        for k in DSPARK_FIELDS:
            d.pop(k)
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

    def _dspark_config(self) -> dict:
        d = asdict(self)
        for k in ("architecture", "conv_kernel_size", "conv_group_size", "selector_rank",
                  "selector_top_k", "input_embedding_scale", "output_multiplier", "own_embed",
                  "own_head", "is_causal", "sliding_window", "confidence_head",
                  "confidence_with_markov", "rope_traditional", "attention_sinks",
                  "draft_vocab_size", "layer_types", "gated_q", "norm_offset", "rope_dims",
                  "backbone", "k_eq_v"):
            d.pop(k)
        lineage = {"dflash_query_causal": True} if self.is_causal else {}
        if self.sliding_window:
            lineage["sliding_window"] = self.sliding_window
        if self.attention_sinks:
            lineage["attention_sink_bias"] = True
        if self.draft_vocab_size:
            lineage["draft_vocab_size"] = self.draft_vocab_size
        if self.gated_q:
            lineage["enable_qwen35_gated_q_proj"] = True
        if self.rope_dims:
            d["rope_parameters"] = {"rope_theta": self.rope_theta,
                                    "partial_rotary_factor": self.rope_dims / self.head_dim}
        d["target_layer_ids"] = list(d["target_layer_ids"])
        if d["rope_scaling"] is None:
            d.pop("rope_scaling")
        if self.backbone == "gemma4":
            d.pop("rope_scaling", None)
            d.update(global_head_dim=d.pop("head_dim"), attention_k_eq_v=self.k_eq_v,
                     rope_parameters={"full_attention": {"rope_theta": d.pop("rope_theta"),
                                                         **self.rope_scaling}})
            d["num_global_key_value_heads" if self.k_eq_v else "num_key_value_heads"] = \
                d.pop("num_key_value_heads")
            return {"architectures": ["Gemma4DSparkModel"], "model_type": "gemma4_text", **d,
                    "enable_confidence_head": self.confidence_head,
                    "confidence_head_with_markov": self.confidence_with_markov, **lineage}
        return {"architectures": ["Qwen3DSparkModel"],
                "model_type": "qwen3_5" if self.norm_offset else "qwen3", **d,
                "enable_confidence_head": self.confidence_head,
                "confidence_head_with_markov": self.confidence_with_markov,
                "rope_is_neox_style": not self.rope_traditional, **lineage}


DSPARK_FIELDS = ("logits_start", "markov_rank", "confidence_head", "confidence_with_markov",
                 "attention_bias", "rope_traditional", "own_embed", "own_head",
                 "attention_sinks", "draft_vocab_size", "gated_q", "norm_offset", "rope_dims",
                 "backbone", "k_eq_v")


def deepspec_schema(cfg: dict, source: str) -> tuple[dict, str]:
    """A DSpark config in any of its packagings, in DeepSpec's schema (every key top level)
    -> (config, packaging: "speculators", "SpecForge", "LiquidAI" or "" as it came)."""
    dcfg = cfg.get("dflash_config") or {}
    archs = " ".join(str(a) for a in cfg.get("architectures") or [])
    if "speculators_config" in cfg or "speculators_model_type" in cfg:
        return _speculators(cfg, source), "speculators"
    if dcfg.get("projector_type") == "dspark":
        out = {**cfg, **{k: dcfg[k] for k in ("target_layer_ids", "mask_token_id")
                         if k not in cfg and dcfg.get(k) is not None}}
        out.setdefault("logits_start", 0)
        return out, "SpecForge"
    if "DSpark" in archs and "target_layer_ids" not in cfg and "target_layer_ids" in dcfg:
        out = {**cfg, **{k: dcfg[k] for k in ("target_layer_ids", "mask_token_id",
                                               "num_target_layers")
                         if k not in cfg and dcfg.get(k) is not None}}
        out.setdefault("logits_start", 0)
        return out, "LiquidAI"
    return cfg, ""


def _speculators(cfg: dict, source: str) -> dict:
    """vLLM speculators' DSpark layout read into DeepSpec's: the backbone from
    `transformer_layer_config`, the taps from `aux_hidden_state_layer_ids`, a causal sliding
    window where the backbone declares one, the first slot from the proposal's
    `speculative_tokens` (block - tokens), else `sample_from_anchor`, else 1."""
    spec = cfg.get("speculators_config") or {}
    algorithm = cfg.get("speculators_model_type") or spec.get("algorithm")
    if algorithm != "dspark":
        raise CheckpointError(f"{source}: a vLLM speculators checkpoint of algorithm "
                              f"{algorithm!r}; only 'dspark' drafters load here")
    layer = cfg.get("transformer_layer_config")
    taps = cfg.get("aux_hidden_state_layer_ids")
    if not isinstance(layer, dict) or not taps:
        missing = "transformer_layer_config" if not isinstance(layer, dict) else \
            "aux_hidden_state_layer_ids"
        raise CheckpointError(f"{source}: missing key '{missing}' (a speculators DSpark config "
                              "names its backbone and taps there)")
    out = {k: layer[k] for k in ("hidden_size", "vocab_size", "num_hidden_layers",
                                 "intermediate_size", "num_attention_heads",
                                 "num_key_value_heads", "head_dim", "rms_norm_eps",
                                 "attention_bias", "rope_parameters", "rope_theta")
           if k in layer}
    out.setdefault("num_key_value_heads", layer.get("num_attention_heads"))
    out.update(model_type=layer.get("model_type", "qwen3"), target_layer_ids=list(taps))
    for k in ("block_size", "mask_token_id", "markov_rank", "enable_confidence_head",
              "confidence_head_with_markov", "final_logit_softcapping", "draft_vocab_size",
              "attention_sink_bias"):
        if k in cfg:
            out[k] = cfg[k]
    kinds = layer.get("layer_types") or []
    if "sliding_attention" in kinds and layer.get("use_sliding_window") and \
            layer.get("sliding_window"):
        out["sliding_window"] = int(layer["sliding_window"])
        out["dflash_query_causal"] = not cfg.get("sliding_window_non_causal", False)
    methods = spec.get("proposal_methods") or []
    tokens = methods[0].get("speculative_tokens") if methods else None
    block = out.get("block_size")
    if tokens and block and 0 <= block - tokens < block:
        out["logits_start"] = block - tokens
    elif isinstance(cfg.get("sample_from_anchor"), bool):
        out["logits_start"] = 0 if cfg["sample_from_anchor"] else 1
    else:
        out["logits_start"] = 1
    return out


def _lineage(cfg: dict, dcfg: dict) -> tuple[int | None, bool]:
    """A DFlash-lineage DSpark head's (sliding window, causal block): read only where the head
    says it is one (a causal block, sinks or a `dflash_config`)."""
    causal = bool(cfg.get("dflash_query_causal") or dcfg.get("causal"))
    if not (causal or cfg.get("attention_sink_bias") or dcfg):
        return None, False
    window = (cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None) or \
        (dcfg.get("swa_window_size") if dcfg.get("use_swa") else None)
    return (int(window) if window else None), causal


def _dspark_fields(cfg: dict, dcfg: dict, packaging: str, n_layers: int,
                   head_dim: int) -> tuple[dict, dict]:
    """(the config as the common keys read it, the fields a DSpark config sets): its heads,
    first slot, lineage (causal block, window, sinks), draft vocabulary and backbone, with
    DeepSpec's defaults; its own embedding and head until `load_drafter` sees the tensors."""
    rope, theta = _rope(cfg)
    if packaging != "SpecForge":
        rope = None         # elsewhere a rope scaling is the target config's, copied along
    gemma = "gemma4" in str(cfg.get("model_type", ""))
    if gemma:
        cfg = _gemma4(cfg)
        rope, theta = cfg["rope_scaling"], cfg["rope_theta"]
    window, causal = _lineage(cfg, dcfg)
    rank = int(cfg.get("markov_rank", DSPARK_DEFAULTS["markov_rank"]))
    with_markov = cfg.get("confidence_head_with_markov",
                          DSPARK_DEFAULTS["confidence_head_with_markov"])
    return cfg, dict(
        rope_scaling=rope, rope_theta=theta, sliding_window=window, is_causal=causal,
        layer_types=(("sliding_attention" if window else "full_attention"),) * n_layers,
        num_key_value_heads=cfg.get("num_key_value_heads",
                                    DSPARK_DEFAULTS["num_key_value_heads"]),
        logits_start=_logits_start(cfg), markov_rank=rank,
        confidence_head=bool(cfg.get("enable_confidence_head",
                                     DSPARK_DEFAULTS["enable_confidence_head"])),
        confidence_with_markov=rank > 0 and bool(with_markov),
        attention_bias=bool(cfg.get("attention_bias", False)),
        rope_traditional=cfg.get("rope_is_neox_style", True) is False,
        attention_sinks=bool(cfg.get("attention_sink_bias", False)),
        draft_vocab_size=_draft_vocab(cfg), own_embed=True, own_head=True,
        **(dict(backbone="gemma4", k_eq_v=cfg["attention_k_eq_v"]) if gemma else
           _qwen3_5_flavour(cfg, int(cfg.get("head_dim", head_dim)))))


def _gemma4(cfg: dict) -> dict:
    """A Gemma-4 DSpark backbone's config with its attention's own fields in the common keys:
    the head dim is `global_head_dim`, values the keys (`attention_k_eq_v`) over
    `num_global_key_value_heads`, the rope `rope_parameters.full_attention`'s (proportional,
    a quarter of each head), the logits soft-capped at 30 unless it says otherwise."""
    rope = (cfg.get("rope_parameters") or {}).get("full_attention") or {}
    k_eq_v = bool(cfg.get("attention_k_eq_v", True))
    return {**cfg, "head_dim": int(cfg.get("global_head_dim", 512)), "attention_k_eq_v": k_eq_v,
            "num_key_value_heads": int(cfg.get("num_global_key_value_heads", 1)) if k_eq_v
            else int(cfg.get("num_key_value_heads", 8)),
            "rope_theta": float(rope.get("rope_theta", 1e6)),
            "rope_scaling": {"rope_type": rope.get("rope_type", "proportional"),
                             "partial_rotary_factor": rope.get("partial_rotary_factor", 0.25)},
            "final_logit_softcapping": cfg.get("final_logit_softcapping", 30.0)}


def _qwen3_5_flavour(cfg: dict, head_dim: int) -> dict:
    """A qwen3_5-flavoured DSpark backbone's parts. A partial rotary factor counts only there:
    elsewhere it is the target config's, copied along (DeepSpec writes the drafter's config as
    a copy of the target's), and the drafter's rope turns whole heads."""
    gated = bool(cfg.get("enable_qwen35_gated_q_proj", False))
    offset = cfg.get("model_type") == "qwen3_5"
    factor = float((cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
    dims = int(head_dim * factor) if gated or offset else head_dim
    return {"gated_q": gated, "norm_offset": offset,
            "rope_dims": dims if dims != head_dim else None}


def _draft_vocab(cfg: dict) -> int | None:
    """A reduced draft vocabulary's size (None where it is the whole vocabulary)."""
    size = cfg.get("draft_vocab_size")
    return None if size is None or int(size) == int(cfg.get("vocab_size", -1)) else int(size)


def _architecture(cfg: dict, source: str) -> str:
    archs = cfg.get("architectures") or [DFLASH]
    if DFLASH2 in archs:
        return DFLASH2
    if DFLASH in archs:
        return DFLASH
    if any("DSpark" in str(a) for a in archs) or "markov_rank" in cfg:
        return DSPARK
    raise CheckpointError(f"{source}: 'architectures' is {archs}; expected {DFLASH}, {DFLASH2} "
                          "or a DSpark model (e.g. Qwen3DSparkModel)")


def _logits_start(cfg: dict) -> int:
    """DeepSpec's first-prediction slot: `logits_start`, else `sample_from_anchor` (true: 0,
    false: 1), else 0 (the anchor's row predicts the first draft)."""
    if "logits_start" in cfg:
        return int(cfg["logits_start"])
    if "sample_from_anchor" in cfg:
        return 0 if cfg["sample_from_anchor"] else 1
    return 0


def _rope(cfg: dict) -> tuple[dict | None, float]:
    """(rope scaling, or None for plain RoPE; rope theta) from a config."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or None
    rope_theta = cfg.get("rope_theta", (rope or {}).get("rope_theta", 1e6))
    if rope is not None and rope.get("rope_type", rope.get("type")) in (None, "default"):
        rope = None  # only carries rope_theta: plain RoPE
    return rope, rope_theta
