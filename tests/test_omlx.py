"""oMLX model settings, platform precision defaults and drafter quantization,
in-process. The command-line side is in test_cli.py."""

import json
import warnings

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

import dflash2_mlx
from dflash2_mlx import DFlashNotice, OmlxSettings, OmlxSettingsError, load_omlx_settings
from dflash2_mlx.loading.omlx import default_settings_path, parse_entry
from dflash2_mlx.loading.runtime import resolve_precision
from fixtures import drafter_args, write_drafter


def write_settings(folder, models: dict, name="model_settings.json"):
    path = folder / name
    path.write_text(json.dumps({"version": 1, "models": models}))
    return path


# --------------------------------------------------------------------------- parsing

def test_every_dflash_key_is_read_and_unknown_keys_are_ignored(tmp_path):
    path = write_settings(tmp_path, {"org/model": {
        "dflash_enabled": True, "dflash_draft_model": "org/drafter",
        "dflash_draft_quant_enabled": True, "dflash_draft_quant_weight_bits": 8,
        "dflash_draft_quant_activation_bits": 32, "dflash_draft_quant_group_size": 128,
        "dflash_block_size": 6, "dflash_verify_mode": "dflash", "dflash_max_ctx": 4096,
        "dflash_draft_window_size": 1024, "dflash_in_memory_cache": True, "mtp_enabled": False,
        "max_tokens": 32768, "some_future_key": {"x": 1}}})
    s = load_omlx_settings(path, model_id="org/model")
    assert s == OmlxSettings(model_id="org/model", source=str(path), enabled=True,
                             draft_model="org/drafter", draft_bits=8, draft_group_size=128,
                             draft_activation_bits=32, block_size=6, verify_mode="dflash",
                             max_ctx=4096)
    assert s.drafting
    # a folder holding the file, and oMLX's default location through $OMLX_BASE_PATH
    assert load_omlx_settings(tmp_path, model_id="org/model") == s


def test_default_location(tmp_path, monkeypatch):
    monkeypatch.setenv("OMLX_BASE_PATH", str(tmp_path))
    path = write_settings(tmp_path, {"m": {"dflash_enabled": True}})
    assert default_settings_path() == path
    assert load_omlx_settings(model_id="m").enabled
    monkeypatch.delenv("OMLX_BASE_PATH")
    assert str(default_settings_path()).endswith(".omlx/model_settings.json")


@pytest.mark.parametrize("entry, bits", [
    ({}, None),                                                       # engine default
    ({"dflash_draft_quant_bits": 8}, 8),                              # the older key
    ({"dflash_draft_quant_bits": 8, "dflash_draft_quant_weight_bits": 4}, 4),   # new key wins
    ({"dflash_draft_quant_enabled": True}, 4),                        # on, no width: 4-bit
    ({"dflash_draft_quant_enabled": False, "dflash_draft_quant_weight_bits": 4}, 16),  # off
    ({"dflash_draft_quant_weight_bits": None, "dflash_block_size": None}, None),  # nulls
])
def test_quantization_keys(entry, bits):
    s = parse_entry(entry, "m")
    assert s.draft_bits == bits and s.block_size is None and not s.enabled


@pytest.mark.parametrize("key, value", [
    ("dflash_enabled", "yes"), ("dflash_enabled", None), ("dflash_draft_model", 3),
    ("dflash_draft_model", " "), ("dflash_draft_quant_enabled", 1),
    ("dflash_draft_quant_weight_bits", 3), ("dflash_draft_quant_weight_bits", 2),
    ("dflash_draft_quant_bits", "4"), ("dflash_draft_quant_group_size", 48),
    ("dflash_draft_quant_activation_bits", 8), ("dflash_block_size", 0),
    ("dflash_block_size", True), ("dflash_block_size", 4.0), ("dflash_verify_mode", "tree"),
    ("dflash_max_ctx", -1),
])
def test_bad_values_name_the_key_and_the_file(tmp_path, key, value):
    path = write_settings(tmp_path, {"m": {"dflash_enabled": True, key: value}})
    with pytest.raises(OmlxSettingsError) as e:
        load_omlx_settings(path, model_id="m")
    assert key in str(e.value) and str(path) in str(e.value) and "'m'" in str(e.value)


@pytest.mark.parametrize("content, match", [
    ("{not json", "malformed JSON"),
    ('{"version": 1, "models": []}', "expected"),
    ('{"version": 1, "models": {"other": {}}}', "no entry for model 'm' .entries: other"),
    ('{"version": 1, "models": {"m": 3}}', "expected an object"),
])
def test_bad_files(tmp_path, content, match):
    path = tmp_path / "model_settings.json"
    path.write_text(content)
    with pytest.raises(OmlxSettingsError, match=match):
        load_omlx_settings(path, model_id="m")
    with pytest.raises(OmlxSettingsError, match="no such oMLX settings file"):
        load_omlx_settings(tmp_path / "missing.json", model_id="m")


# --------------------------------------------------------------------------- precision

def test_precision_defaults_and_overrides():
    cpu, metal = resolve_precision(metal=False), resolve_precision(metal=True)
    assert (cpu.dtype, cpu.keep_quantized, cpu.draft_dtype, cpu.draft_bits) == \
        ("float32", False, "float32", None)
    assert (metal.dtype, metal.keep_quantized, metal.draft_bits, metal.draft_group_size) == \
        (None, True, 4, 64)
    p = resolve_precision("bf16", 16, metal=True)
    assert (p.dtype, p.draft_dtype, p.draft_bits) == ("bfloat16", "bfloat16", None)
    p = resolve_precision(mx.float16, 8, 32, "float32", metal=False)
    assert (p.dtype, p.draft_dtype, p.draft_bits, p.draft_group_size) == \
        ("float16", "float32", 8, 32)
    for bad in (dict(dtype="float8"), dict(draft_bits=3), dict(draft_group_size=48)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            resolve_precision(**bad, metal=False)


# --------------------------------------------------------------------------- load(settings=)

@pytest.fixture(scope="module")
def quantizable_dir(tmp_path_factory):
    """A DFlash 2 drafter whose selector codebooks (rank 64) divide into groups of 64."""
    return write_drafter(tmp_path_factory.mktemp("q"), drafter_args(selector_rank=64), seed=5)


def _load(llama_dir, settings=None, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = dflash2_mlx.load(str(llama_dir), kw.pop("draft", None), settings=settings, **kw)
    return pipe, [str(w.message) for w in caught if w.category is DFlashNotice]


def test_4bit_g64_quantizes_linears_and_codebooks_only(llama_dir, quantizable_dir):
    pipe = dflash2_mlx.load(str(llama_dir), str(quantizable_dir), draft_bits=4)
    d = pipe.drafter
    kinds = {type(m) for _, m in d.named_modules()}
    assert nn.Linear not in kinds and nn.Embedding not in kinds        # all of them quantized
    assert isinstance(d.candidate_selector.predecessor_codebook, nn.QuantizedEmbedding)
    assert all(m.bits == 4 and m.group_size == 64 for _, m in d.named_modules()
               if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)))
    floats = {k: v.dtype for k, v in tree_flatten(d.parameters())
              if "norm" in k or "base_kernel" in k}
    assert floats and set(floats.values()) == {mx.float32}           # CPU default dtype
    info = pipe.describe()
    assert (info["draft_bits"], info["draft_group_size"], info["dtype"]) == (4, 64, "float32")
    plain = dflash2_mlx.load(str(llama_dir))
    prompt = "def add(a, b):"
    assert pipe.generate(prompt, max_tokens=24).tokens == plain.generate(prompt,
                                                                          max_tokens=24).tokens


def test_settings_apply_and_arguments_override(llama_dir, dflash2_dir):
    s = OmlxSettings(model_id="m", source="f.json", enabled=True, draft_model=str(dflash2_dir),
                     draft_bits=8, draft_group_size=32, block_size=4, max_ctx=10)
    pipe, notes = _load(llama_dir, s)
    info = pipe.describe()
    assert not notes
    assert (info["block_size"], info["draft_bits"], info["draft_group_size"],
            info["omlx_settings"], info["model_id"]) == (4, 8, 32, "f.json", "m")
    short = pipe.generate([5, 6, 7], max_tokens=6)
    assert short.stats.block_size == 4 and short.stats.cycles > 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        long = pipe.generate(list(range(5, 20)), max_tokens=6)      # >= max_ctx: plain decoding
    assert long.stats.block_size == 1 and long.stats.cycles == 0
    assert any("max_ctx=10" in str(w.message) for w in caught)
    pipe, _ = _load(llama_dir, s, draft_bits=16, draft_group_size=64)
    assert (pipe.describe()["draft_bits"], pipe.describe()["draft_group_size"]) == (16, None)
    pipe, _ = _load(llama_dir, OmlxSettings("m", enabled=True, draft_model=str(dflash2_dir),
                                            draft_activation_bits=16))
    assert pipe.describe()["draft_dtype"] == "bfloat16"


def test_settings_that_turn_drafting_off(llama_dir, dflash2_dir):
    for s, why, lookup in ((OmlxSettings("m", enabled=False, draft_model=str(dflash2_dir)),
                            "dflash_enabled is false: no drafter", True),
                           (OmlxSettings("m", enabled=True, verify_mode="off",
                                         draft_model=str(dflash2_dir)),
                            'dflash_verify_mode is "off": plain target decoding', False)):
        pipe, notes = _load(llama_dir, s)
        assert pipe.drafter is None and any(why in n for n in notes), notes
        assert pipe.lookup is lookup           # "off" is no speculation at all
        pipe, notes = _load(llama_dir, s, draft=str(dflash2_dir))     # explicit drafter wins
        assert pipe.drafter is not None and any("explicitly" in n for n in notes)
    pipe, notes = _load(llama_dir, OmlxSettings("m", enabled=True, verify_mode="adaptive",
                                                draft_model=str(dflash2_dir)))
    assert pipe.drafter is not None
    assert pipe.describe()["block_size"] == "auto"
    assert pipe.describe()["verify_mode"] == "adaptive"


@pytest.mark.parametrize("settings, match", [
    (OmlxSettings("m", "f.json", enabled=True, verify_mode="ddtree"), "ddtree.*not supported"),
    (OmlxSettings("m", "f.json", enabled=True), "dflash_draft_model is not set"),
    (OmlxSettings("m", "f.json", enabled=True, block_size=17, draft_model="DRAFT"),
     "dflash_block_size = 17 exceeds the drafter's block size 16"),
])
def test_settings_errors_at_load(llama_dir, dflash2_dir, settings, match):
    if settings.draft_model == "DRAFT":
        settings = OmlxSettings(**{**settings.to_dict(), "draft_model": str(dflash2_dir)})
    with pytest.raises(OmlxSettingsError, match=f"f.json: model 'm': .*{match}"):
        dflash2_mlx.load(str(llama_dir), settings=settings)


def test_stored_quantized_drafter(llama_dir, quantizable_dir, tmp_path):
    """A drafter saved 4-bit: dequantized to float32 by the CPU default, kept with
    --draft-bits 4, and kept (with a notice) when other bits are asked for."""
    from dflash2_mlx.loading.checkpoint import save_drafter

    q4 = save_drafter(dflash2_mlx.load(str(llama_dir), str(quantizable_dir),
                                       draft_bits=4).drafter, tmp_path / "q4")
    default, notes = _load(llama_dir, draft=str(q4))
    assert (default.describe()["draft_bits"], default.describe()["draft_dtype"], notes) == \
        (16, "float32", [])
    kept, notes = _load(llama_dir, draft=str(q4), draft_bits=4)
    assert kept.describe()["draft_bits"] == 4 and not notes
    other, notes = _load(llama_dir, draft=str(q4), draft_bits=8)
    assert other.describe()["draft_bits"] == 4 and "stored 4-bit" in notes[0]
    prompt = [5, 6, 7, 8]
    assert default.generate(prompt, max_tokens=16).tokens == \
        kept.generate(prompt, max_tokens=16).tokens
