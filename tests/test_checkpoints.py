"""Drafter configs and weights: the published format, and a clear error for every bad case."""

import json
import shutil

import mlx.core as mx
import pytest

import dflash2_mlx
from dflash2_mlx.model.config import CheckpointError, DrafterArgs
from dflash2_mlx.loading.checkpoint import load_drafter
from fixtures import HIDDEN, TARGET_LAYERS, VOCAB, drafter_args, write_drafter

# Shaped like z-lab/Qwen3.8-27B-DFlash2's config (the published layout), scaled down.
DFLASH2_CONFIG = {
    "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "intermediate_size": 128, "vocab_size": 384, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960, "num_target_layers": 4,
    "rope_parameters": {"rope_theta": 1e7, "rope_type": "default"},
    "layer_types": ["sliding_attention", "sliding_attention"], "sliding_window": 2048,
    "is_causal": False,
    "dflash_config": {"block_size": 8, "target_layer_ids": [0, 3], "mask_token_id": 380,
                      "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 32,
                      "selector_top_k": 16, "output_multiplier": 0.25,
                      "final_logit_softcapping": 20.0},
}
# Shaped like z-lab/Qwen3-4B-DFlash-b16's: DFlash 1, block_size at the top level.
DFLASH_CONFIG = {
    "architectures": ["DFlashDraftModel"], "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 128, "vocab_size": 384, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
    "max_position_embeddings": 40960, "num_target_layers": 4, "block_size": 16,
    "dflash_config": {"target_layer_ids": [1, 2], "mask_token_id": 383},
}


def test_parse_dflash2_config():
    args = DrafterArgs.from_dict(DFLASH2_CONFIG)
    assert args.has_conv and args.has_selector and args.architecture == "DFlash2DraftModel"
    assert args.block_size == 8 and args.target_layer_ids == (0, 3)
    assert args.rope_theta == 1e7 and args.rope_scaling is None
    assert args.sliding_only and args.sliding_window == 2048 and not args.is_causal
    assert (args.conv_kernel_size, args.conv_group_size) == (2, 16)
    assert (args.selector_rank, args.selector_top_k) == (32, 16)
    assert args.output_multiplier == 0.25 and args.final_logit_softcapping == 20.0


def test_parse_dflash_config_top_level_block_size():
    args = DrafterArgs.from_dict(DFLASH_CONFIG)
    assert not args.has_conv and not args.has_selector
    assert args.block_size == 16 and args.layer_types == ("full_attention",) * 2
    assert args.rope_theta == 1e6 and args.mask_token_id == 383


def test_dflash_config_wins_over_top_level():
    cfg = json.loads(json.dumps(DFLASH_CONFIG))
    cfg["dflash_config"]["block_size"] = 4
    assert DrafterArgs.from_dict(cfg).block_size == 4


def test_dflash2_defaults_and_rope_scaling():
    cfg = json.loads(json.dumps(DFLASH2_CONFIG))
    for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        del cfg["dflash_config"][k]
    cfg["vocab_size"] = 65536
    cfg["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}
    args = DrafterArgs.from_dict(cfg)
    assert (args.conv_kernel_size, args.conv_group_size) == (2, 16)
    assert (args.selector_rank, args.selector_top_k) == (256, 16)
    assert args.rope_theta == 5e5 and args.rope_scaling["rope_type"] == "linear"


def test_round_trip_through_to_config():
    args = drafter_args(dflash2=True, layer_types=("sliding_attention", "full_attention"),
                        sliding_window=64, final_logit_softcapping=30.0)
    assert DrafterArgs.from_dict(args.to_config()) == args


def edit(cfg, path, value):
    cfg = json.loads(json.dumps(cfg))
    *parents, key = path
    node = cfg
    for p in parents:
        node = node[p]
    if value is DEL:
        del node[key]
    else:
        node[key] = value
    return cfg


DEL = object()
BAD_CONFIGS = [
    (("dflash_config", "block_size"), 1, "'block_size' must be >= 2"),
    (("dflash_config", "target_layer_ids"), DEL, "missing key 'target_layer_ids'"),
    (("dflash_config", "mask_token_id"), DEL, "missing key 'mask_token_id'"),
    (("hidden_size",), DEL, "missing key 'hidden_size'"),
    (("architectures",), ["LlamaForCausalLM"], "'architectures'"),
    (("layer_types",), ["full_attention"], "'layer_types' has 1 entries"),
    (("layer_types",), ["full_attention", "chunked"], "unsupported entries ['chunked']"),
    (("sliding_window",), None, "'sliding_window' must be a positive integer"),
    (("dflash_config", "conv_group_size"), 48, "'conv_group_size' (48) must divide"),
    (("num_key_value_heads",), 3, "'num_key_value_heads' (3) must divide"),
    (("dflash_config", "selector_top_k"), 1000, "'selector_top_k' (1000) exceeds"),
    (("dflash_config",), [1, 2], "'dflash_config' must be an object"),
]


@pytest.mark.parametrize("path,value,message", BAD_CONFIGS,
                         ids=[m.split("'")[1] if "'" in m else m for _, _, m in BAD_CONFIGS])
def test_bad_config_errors_name_file_and_key(tmp_path, path, value, message):
    (tmp_path / "config.json").write_text(json.dumps(edit(DFLASH2_CONFIG, path, value)))
    with pytest.raises(CheckpointError) as e:
        DrafterArgs.from_file(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value)
    assert message in str(e.value)


def test_malformed_json_names_file(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 64,')
    with pytest.raises(CheckpointError, match="config.json: malformed JSON"):
        DrafterArgs.from_file(tmp_path)


def test_missing_config_names_file(tmp_path):
    with pytest.raises(CheckpointError, match="config.json: no such file"):
        DrafterArgs.from_file(tmp_path)


def _load(folder):
    return load_drafter(folder, hidden_size=HIDDEN, vocab_size=VOCAB, num_layers=TARGET_LAYERS)


@pytest.fixture
def drafter_copy(dflash2_dir, tmp_path):
    folder = tmp_path / "d"
    shutil.copytree(dflash2_dir, folder)
    return folder


def rewrite_weights(folder, change):
    weights = mx.load(str(folder / "model.safetensors"))
    change(weights)
    mx.save_safetensors(str(folder / "model.safetensors"), weights)


def test_published_names_load(drafter_copy):
    weights = mx.load(str(drafter_copy / "model.safetensors"))
    assert "candidate_selector.predecessor_codebook" in weights       # no ".weight" suffix
    assert all(v.dtype == mx.bfloat16 for v in weights.values())
    assert _load(drafter_copy).args.has_selector


def test_stray_embedding_and_head_are_ignored(drafter_copy):
    rewrite_weights(drafter_copy, lambda w: w.update({
        "embed_tokens.weight": mx.zeros((VOCAB, HIDDEN)), "lm_head.weight": mx.zeros((VOCAB, HIDDEN))}))
    _load(drafter_copy)


@pytest.mark.parametrize("change,message", [
    (lambda w: w.pop("layers.1.mlp.up_proj.weight"), "missing tensors: layers.1.mlp.up_proj.weight"),
    (lambda w: w.pop("candidate_selector.successor_codebook"),
     "missing tensors: candidate_selector.successor_codebook"),
    (lambda w: w.update({"layers.0.extra.weight": mx.zeros((2,))}),
     "unexpected tensors: layers.0.extra.weight"),
    (lambda w: w.update({"fc.weight": mx.zeros((HIDDEN, 3))}),
     "mis-shaped tensors: fc.weight (64, 3) (expected (64, 128))"),
])
def test_bad_weights_are_named(drafter_copy, change, message):
    rewrite_weights(drafter_copy, change)
    with pytest.raises(CheckpointError) as e:
        _load(drafter_copy)
    assert str(drafter_copy) in str(e.value) and message in str(e.value)


def test_all_weight_problems_reported_together(drafter_copy):
    def change(w):
        w.pop("norm.weight")
        w["bogus"] = mx.zeros((1,))
        w["hidden_norm.weight"] = mx.zeros((3,))
    rewrite_weights(drafter_copy, change)
    with pytest.raises(CheckpointError) as e:
        _load(drafter_copy)
    for part in ("missing tensors: norm.weight", "unexpected tensors: bogus",
                 "mis-shaped tensors: hidden_norm.weight"):
        assert part in str(e.value)


def test_malformed_safetensors_names_file(drafter_copy):
    (drafter_copy / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="model.safetensors: not a readable safetensors"):
        _load(drafter_copy)


def test_no_weights_names_folder(drafter_copy):
    (drafter_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors weight files"):
        _load(drafter_copy)


@pytest.mark.parametrize("kwargs,message", [
    (dict(hidden_size=32), "'hidden_size' is 64 but the target's hidden size is 32"),
    (dict(vocab_size=1000), "'vocab_size' is 384 but the target's vocabulary has 1000"),
    (dict(num_layers=2), "'target_layer_ids' [2] are outside the target's layers 0..1"),
])
def test_mismatch_with_target(dflash2_dir, kwargs, message):
    shape = dict(hidden_size=HIDDEN, vocab_size=VOCAB, num_layers=TARGET_LAYERS) | kwargs
    with pytest.raises(CheckpointError) as e:
        load_drafter(dflash2_dir, **shape)
    assert message in str(e.value) and "config.json" in str(e.value)


def test_mask_token_outside_vocab(tmp_path, llama_dir):
    folder = write_drafter(tmp_path / "d", drafter_args(mask_token_id=VOCAB + 5))
    with pytest.raises(CheckpointError, match="'mask_token_id' 389 is outside target model '.*'s vocabulary"):
        dflash2_mlx.load(str(llama_dir), str(folder))


def test_missing_paths_are_clear(tmp_path, llama_dir):
    with pytest.raises(FileNotFoundError, match="draft model '.*nowhere': no such file"):
        dflash2_mlx.load(str(llama_dir), str(tmp_path / "nowhere"))
    with pytest.raises(OSError, match="draft model 'no-such-org/no-such-drafter'"):
        dflash2_mlx.load(str(llama_dir), "no-such-org/no-such-drafter")   # tests/test_hub.py


def test_runtime_block_size_bounds(llama_dir, dflash2_dir):
    pipe = dflash2_mlx.load(str(llama_dir), str(dflash2_dir))
    for bad in (0, 17, 2.5):
        with pytest.raises(ValueError, match="block_size: .* is not an integer in 1..16"):
            pipe.generate("hi", max_tokens=2, block_size=bad)


def test_draft_vocab_round_trip_and_errors(dflash2_dir, tmp_path):
    import shutil
    folder = tmp_path / "dv"
    shutil.copytree(dflash2_dir, folder)
    ids = list(range(0, VOCAB, 3))
    (folder / "draft_vocab.json").write_text(json.dumps(ids))
    drafter = _load(folder)
    assert drafter.draft_vocab.ids.tolist() == ids
    from dflash2_mlx.loading.checkpoint import save_drafter
    again = _load(save_drafter(drafter, tmp_path / "saved"))
    assert again.draft_vocab.ids.tolist() == ids
    for bad in ([5, 3], [1, 1, 2], [0, VOCAB], "x", list(range(4))):
        (folder / "draft_vocab.json").write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match="draft_vocab.json"):
            _load(folder)
