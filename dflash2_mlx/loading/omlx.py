"""oMLX model settings: the DFlash keys of oMLX's per-model `model_settings.json`.

oMLX keeps per-model settings in `<base>/model_settings.json`, base = `$OMLX_BASE_PATH` or
`~/.omlx`, shaped `{"version": 1, "models": {"<model_id>": {<key>: <value>, ...}}}`.
`load_omlx_settings()` reads one model's entry into an `OmlxSettings` that `dflash2_mlx.load`
accepts (`settings=`). Unknown keys are ignored; a bad value raises `OmlxSettingsError` naming
the key and the file.

This module must not import mlx (the CLI validates settings before loading anything).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import settings as check

SETTINGS_FILE = "model_settings.json"
BASE_ENV = "OMLX_BASE_PATH"
VERIFY_MODES = ("dflash", "adaptive", "ddtree", "off")
ACTIVATION_BITS = (16, 32)


class OmlxSettingsError(ValueError):
    """A settings file or value that cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class OmlxSettings:
    """One model's DFlash settings. None means "not set": the engine's default applies.

    draft_bits: 4 or 8 (quantize the drafter), 16 (`dflash_draft_quant_enabled: false`:
    unquantized) or None. draft_activation_bits: 16 (bfloat16 drafter) or 32 (float32).
    kv_bits, kv_group_size: the target's quantized KV cache (dflash2-mlx's own keys
    `dflash_kv_bits`, `dflash_kv_group_size`; oMLX has none for mlx-lm's quantized cache).
    """

    model_id: str
    source: str = "<settings>"           # the file, for messages
    enabled: bool = False                # oMLX's default: DFlash off unless enabled
    draft_model: str | None = None
    draft_bits: int | None = None
    draft_group_size: int | None = None
    draft_activation_bits: int | None = None
    block_size: int | None = None
    verify_mode: str | None = None
    max_ctx: int | None = None
    kv_bits: int | None = None
    kv_group_size: int | None = None

    def where(self, key: str) -> str:
        return f"{self.source}: model '{self.model_id}': {key}"

    @property
    def drafting(self) -> bool:
        """False when the file turns DFlash off (`dflash_enabled` false or verify mode "off")."""
        return self.enabled and self.verify_mode != "off"

    def check(self, draft: str | None = None) -> None:
        """The errors found without loading anything: an unsupported verify mode, or DFlash on
        with no drafter (`draft` is one given explicitly)."""
        if self.verify_mode == "ddtree":
            raise OmlxSettingsError(f"{self.where('dflash_verify_mode')} = \"ddtree\": DDTree "
                                    "verification is not supported by dflash2-mlx; use "
                                    "\"dflash\", \"adaptive\" or \"off\"")
        if self.drafting and draft is None and self.draft_model is None:
            raise OmlxSettingsError(f"{self.where('dflash_draft_model')} is not set and no "
                                    "drafter was given (--draft / draft=)")

    def to_dict(self) -> dict:
        return asdict(self)


def default_settings_path() -> Path:
    """`$OMLX_BASE_PATH/model_settings.json`, else `~/.omlx/model_settings.json`."""
    base = os.environ.get(BASE_ENV)
    return (Path(base).expanduser() if base else Path.home() / ".omlx") / SETTINGS_FILE


def _read(path: Path) -> dict:
    if path.is_dir():
        path = path / SETTINGS_FILE
    if not path.is_file():
        hint = "" if path != default_settings_path() else (
            f" (oMLX's default location; set ${BASE_ENV} or give a path)")
        raise OmlxSettingsError(f"{path}: no such oMLX settings file{hint}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise OmlxSettingsError(f"{path}: malformed JSON ({e})") from e
    except (OSError, UnicodeDecodeError) as e:
        raise OmlxSettingsError(f"{path}: cannot be read ({e})") from e
    if not isinstance(data, dict) or not isinstance(data.get("models", {}), dict):
        raise OmlxSettingsError(f"{path}: expected {{\"version\": 1, \"models\": {{...}}}}")
    return data


def parse_entry(entry: dict, model_id: str, source: str = "<settings>") -> OmlxSettings:
    """Validate the DFlash keys of one `models` entry; unknown keys are ignored."""
    def bad(key, value, allowed):
        raise OmlxSettingsError(f"{source}: model '{model_id}': {key} = {json.dumps(value)} is "
                                f"not allowed; expected {allowed}")

    def get(key, kind, allowed=None, nullable=True, describe=None, validate=None):
        if key not in entry or (entry[key] is None and nullable):
            return None
        value = entry[key]
        if validate is not None:          # the validator the CLI and the API use too
            try:
                return validate(value, key) if isinstance(value, kind) else bad(
                    key, value, describe)
            except check.SettingError:
                bad(key, value, describe)
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if ok and allowed is not None:
            ok = value in allowed if isinstance(allowed, tuple) else allowed(value)
        if not ok:
            bad(key, value, describe or (" or ".join(map(json.dumps, allowed))
                                         + (" or null" if nullable else "")))
        return value

    if not isinstance(entry, dict):
        raise OmlxSettingsError(f"{source}: model '{model_id}': expected an object of settings")
    enabled = get("dflash_enabled", bool, nullable=False, describe="true or false")
    draft = get("dflash_draft_model", str, lambda v: bool(v.strip()),
                describe="a hub id or a local path")
    quant = get("dflash_draft_quant_enabled", bool, describe="true or false")
    bits = None
    for key in ("dflash_draft_quant_weight_bits", "dflash_draft_quant_bits"):   # new key first
        value = get(key, int, lambda v: v in (2, 4, 8), describe="4 or 8 (or null)")
        if value == 2:
            raise OmlxSettingsError(f"{source}: model '{model_id}': {key} = 2: 2-bit drafters "
                                    "are not supported by dflash2-mlx; use 4 or 8")
        bits = bits if value is None or bits is not None else value
    if quant is False:
        bits = 16                        # quantization explicitly off: unquantized drafter
    elif quant is True and bits is None:
        bits = 4                         # on, without a bit width: the design's default
    group = get("dflash_draft_quant_group_size", int, describe="32 or 64 or 128 or null",
                validate=check.draft_group_size)
    act = get("dflash_draft_quant_activation_bits", int, ACTIVATION_BITS)
    block = get("dflash_block_size", int, validate=check.block_size,   # ints only: no "auto"
                describe="an integer >= 1, or null (the drafter's own block size)")
    mode = get("dflash_verify_mode", str, VERIFY_MODES)
    max_ctx = get("dflash_max_ctx", int, lambda v: v >= 1,
                  describe="an integer >= 1 (prompt tokens), or null")
    kv_bits = get("dflash_kv_bits", int, describe="4 or 8 (or null: a float KV cache)",
                  validate=check.kv_bits)
    kv_group = get("dflash_kv_group_size", int, describe="32 or 64 or 128 or null",
                   validate=check.kv_group_size)
    return OmlxSettings(model_id=model_id, source=source, enabled=bool(enabled),
                        draft_model=draft, draft_bits=bits, draft_group_size=group,
                        draft_activation_bits=act, block_size=block, verify_mode=mode,
                        max_ctx=max_ctx, kv_bits=kv_bits, kv_group_size=kv_group)


def load_omlx_settings(path: str | Path | None = None, *, model_id: str) -> OmlxSettings:
    """Read oMLX's `model_settings.json` (a file, a folder holding one, or None for oMLX's
    default location) and return the entry of `model_id`.

    Raises OmlxSettingsError when the file is missing or malformed, has no entry for
    `model_id` (the message lists the ids it has), or a DFlash key has a bad value.
    """
    file = Path(path).expanduser() if path is not None else default_settings_path()
    data = _read(file)
    if file.is_dir():
        file = file / SETTINGS_FILE
    models = data.get("models", {})
    if model_id not in models:
        have = ", ".join(sorted(models)) or "none"
        raise OmlxSettingsError(f"{file}: no entry for model '{model_id}' (entries: {have})")
    return parse_entry(models[model_id], model_id, str(file))


__all__ = ["OmlxSettings", "OmlxSettingsError", "load_omlx_settings", "default_settings_path",
           "parse_entry"]
