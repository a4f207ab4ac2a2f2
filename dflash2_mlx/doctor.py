"""What `dflash2-mlx doctor` reports and what `dflash2-mlx calibrate` redoes.

`report()` yields (name, value) rows as it measures them: versions, platform, the backend, the
BLAS in effect and its fp32 matmul rate, kernels, precision defaults, the embedded default,
caches and stored cost calibrations (`calibration_rows`). `recalibrate()` times the draft and
verify costs of one pair, or of every stored pair, again. MLX is imported inside the functions,
after the command has chosen the BLAS (`blas.use_fast_blas`).
"""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path
from typing import Iterator

from . import __version__, log
from .loading import blas, runtime

_log = log.get(__name__)

Rows = Iterator[tuple[str, str]]


def report(model: str | None = None) -> Rows:
    """Every row `doctor` prints, in order; with `model`, its section last (`model_rows`)."""
    yield from _versions()
    yield from _compute()
    yield from _storage()
    if model is not None:
        yield from model_rows(model)


def model_rows(model: str) -> Rows:
    """What `doctor --model X` adds, from X's config.json only (a local folder's, or that one
    file from the Hub): its shape and the drafter a `--model X` run would take, and why. Each
    part is a function of the config read once."""
    from .loading.drafters import Shape

    config, where = model_config(model)
    shape = Shape.of(config)
    yield "model", f"{model} (config.json: {where})"
    yield "shape", str(shape) if shape else "unknown (config.json lacks the fields)"
    yield from _drafter_rows(model, config)


def _drafter_rows(model: str, config: dict) -> Rows:
    """The drafter a run with `--model model` and no --draft takes, and why."""
    from .loading.drafters import find

    choice = find(config, model)
    if choice.row is None:
        yield "drafter", f"none: {choice.why}; lookup drafting only unless --draft names one"
        return
    row = choice.row
    yield "drafter", f"{row.drafter} (block size {row.block_size}): {choice.why}"
    yield "drafter card", row.card + (f" ({row.note})" if row.note else "")


def _package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def _versions() -> Rows:
    import mlx.core as mx

    from .distributed import availability

    yield log.PROG, f"{__version__} ({Path(__file__).parent})"
    yield "python", f"{platform.python_version()} ({sys.executable})"
    yield "platform", f"{platform.system()} {platform.machine()}"
    yield "mlx", (f"{mx.__version__}, backend {'Metal (GPU)' if runtime.on_metal() else 'CPU'}"
                  f"{'' if mx.metal.is_available() else ' (Metal not available)'}")
    yield "mlx-lm", _package_version("mlx-lm")
    yield "distributed", availability()
    if sys.platform.startswith("linux"):
        chosen, now = blas.use_fast_blas(), blas.active()
        yield "blas", (f"{now.name} ({now.path or now.how}; ${blas.ENV}="
                       f"{os.environ.get(blas.ENV) or 'auto'}: {'|'.join(blas.CHOICES)})"
                       + (f"; note: {chosen.note}" if chosen.note else ""))


def _compute() -> Rows:
    import mlx.core as mx

    from .model.kernels import kernel_setting, metal_usable, resolve_kernel_path

    a = mx.random.normal((512, 512))
    for _ in range(3):            # MKL loads its CPU-specific kernels on the first calls
        mx.eval(a @ a)
    tic = time.perf_counter()
    for _ in range(5):
        mx.eval(a @ a)
    yield "fp32 matmul", (f"{5 * 2 * 512 ** 3 / (time.perf_counter() - tic) / 1e9:.0f} GFLOP/s "
                          "(512 x 512)")
    try:
        setting = kernel_setting(None)
        drafter = {"metal": "custom Metal kernels",
                   "ops": "MLX-ops twins, compiled"}[resolve_kernel_path(None)]
        verify = ("stock" if setting == "stock" else "custom everywhere" if setting == "metal"
                  else "where the probe chose them (the `kernel probe` rows)" if
                  metal_usable() else "stock (no Metal)")
        kernels = f"{setting}: drafter {drafter}; target verify kernels {verify}"
    except (ValueError, RuntimeError) as e:
        kernels = f"error: {e}"
    yield "kernels", kernels
    p = runtime.resolve_precision(metal=runtime.on_metal())
    yield "precision", (
        f"target {p.dtype or 'as stored'}"
        f"{'' if p.keep_quantized else ' (quantized layers dequantized)'}, drafter "
        f"{f'{p.draft_bits}-bit g{p.draft_group_size}' if p.draft_bits else 'unquantized'}"
        f" {p.draft_dtype or ''}".rstrip() + " (--dtype / --draft-bits override)")


def _folder_size(path: Path) -> str:
    if not path.exists():
        return "absent"
    total = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return f"{total / 1e6:.0f} MB"


def _storage() -> Rows:
    from .loading.assets import resolve_cache_dir
    from .loading.omlx import default_settings_path

    try:
        from .loading import defaults
        where = getattr(defaults, "drafter_path", None)
        yield "default model", f"installed (drafter {where()})" if where else "installed"
    except ImportError:
        yield "default model", "not installed in this version (pass --model)"
    except (OSError, ValueError) as e:
        yield "default model", f"unavailable: {e}"
    cache = resolve_cache_dir()
    hf = os.environ.get("HF_HUB_CACHE") or str(
        Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub")
    omlx = default_settings_path()
    yield "cache", f"{cache} ({_folder_size(cache)}; set $DFLASH2_CACHE to move it)"
    yield "hub cache", f"{hf} ({_folder_size(Path(hf))})"
    yield "omlx settings", f"{omlx} ({'present' if omlx.is_file() else 'absent'})"
    for line in calibration_rows():
        yield "calibration", line
    for line in kernel_rows():
        yield "kernel probe", line


def kernel_rows() -> list[str]:
    """One line per shape class the verify kernels' probe decided, per stored calibration: the
    choice, why, and stock/custom microseconds per width (`model.kernel_probe`)."""
    from .policy.calibration import stored_calibrations
    from .model.kernel_probe import decision_rows

    rows = [row for entry in stored_calibrations().values() if entry.get("kernels") is not None
            for row in decision_rows(entry["kernels"])]
    return rows or ["none probed (the probe runs with the first calibration on a Mac)"]


def model_config(model: str) -> tuple[dict, str]:
    """(config, where it came from) of a target, reading its config and nothing else: a
    local folder's config.json, a GGUF file's header, or the Hub's config.json alone."""
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from dataclasses import asdict

        from .loading.gguf import model_args, read_gguf_header

        return asdict(model_args(read_gguf_header(path), source=str(path))), str(path)
    from .loading.drafters import target_config

    return target_config(model)


def memory_rows(model: str) -> list[str]:
    """`doctor --model M`: M's KV cache bytes per token in float, 8-bit and 4-bit, and the
    tokens of context that fit on this machine beside its weights (`memory.fit_lines`), at
    the precision `load` would give it here."""
    config, where = model_config(model)
    try:
        return [f"config          {where}"] + _fit_lines(config)
    except ValueError as e:         # a config without the attention shape: the rest still stands
        return [f"config          {where}", f"unknown         {e}"]


def _fit_lines(config: dict) -> list[str]:
    from .model import memory

    device, source = memory.device_memory()
    p = runtime.resolve_precision(metal=runtime.on_metal())
    text = memory.text_config(config)
    stored = 4 if str(text.get("torch_dtype") or text.get("dtype")) == "float32" else 2
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}.get(p.dtype, stored)
    # quantized weights stay quantized on Metal; the CPU dequantizes them to p.dtype
    weights = memory.estimate_weights(config, None if p.keep_quantized else itemsize)
    return memory.fit_lines(config, device=device, source=source, itemsize=itemsize,
                            weights=weights) + memory.vision_lines(config, itemsize)


def calibration_rows() -> list[str]:
    """One line per stored cost calibration (`policy.calibration.cache_file()`): the pair, backend and
    BLAS it was taken with, when, how long, how far its rounds disagreed, and whether the next
    load uses it or times it again."""
    from .policy.calibration import cache_file, stale, stored_calibrations
    from .policy.costs import SPREAD

    entries = stored_calibrations()
    if not entries:
        return [f"none stored ({cache_file()}; the first `auto` run takes one)"]
    out = []
    for key, entry in entries.items():
        meta = entry.get("meta") if isinstance(entry.get("meta"), dict) else {}
        spread = entry.get("spread")
        why = stale(entry)
        state = (f"timed again at the next load: {why}" if why else
                 "timed again at the next load: its rounds disagreed (a busy machine?)"
                 if isinstance(spread, (int, float)) and spread > SPREAD else
                 "timed again at the next load: no context slope fitted"
                 if entry.get("fitted") is False else "settled")
        pair = " + ".join(Path(str(p)).name for p in (meta.get("model"), meta.get("draft"))
                          if p) or "pair unknown"
        spread_text = f"{100 * spread:.0f}%" if isinstance(spread, (int, float)) else "?"
        corrected = f", prices corrected {meta['corrected']}" if meta.get("corrected") else ""
        out.append(f"{pair} ({meta.get('backend', '?')}, BLAS {meta.get('blas', '?')}, key "
                   f"{key}): taken {meta.get('when', '?')} in {meta.get('seconds', '?')} s, "
                   f"rounds within {spread_text}{corrected}; {state}")
    return out


def recalibrate(model: str | None = None, draft: str | None = None) -> None:
    """Time the draft and verify costs that `auto` prices its choices by again: of the pair
    given (the embedded default when neither is), or, with neither given and calibrations
    stored, of every stored pair; then the entries not timed again are forgotten (the next
    load with their settings times them). Progress: one log line per pair."""
    from .policy import calibration
    from .pair import load

    stored = calibration.stored_calibrations()
    if model is not None or draft is not None or not stored:
        pairs = [(model, draft)]
    else:
        pairs = list(dict.fromkeys(
            (m.get("model"), m.get("draft")) for m in (
                e.get("meta") for e in stored.values()) if isinstance(m, dict)))
    done = set()
    for i, (m, d) in enumerate(pairs, 1):
        _log.info(f"calibration {i} of {len(pairs)}: {m or 'the embedded default'}"
                  + (f" with {d}" if d else ""))
        try:
            pipe = load(m, d)
        except (OSError, ValueError) as e:
            _log.warning(f"{m}: not loaded ({e}); its calibration is removed")
            continue
        calibration.load_or_measure_costs(pipe, pipe.max_width(True), fresh=True)
        done.add(calibration.calibration_key(pipe))
    if model is None and draft is None:
        # entries of other load settings (dtype, oMLX entry) or of an older format: the
        # next load with those settings times them again
        calibration.forget_calibrations([k for k in stored if k not in done])
