"""Tiny random-weight vision-language model folders, in the real on-disk format.

`write_vlm(folder, family)` writes a folder that both loaders open offline:

- `mlx_vlm.load(folder)` -> (model, processor): the full model (vision tower + language model)
  and the family's own processor (mlx-vlm's patched AutoProcessor); mlx-vlm's generation with
  an image works (`vlm_greedy` below is that reference);
- `mlx_lm.utils.load(folder)` -> (model, tokenizer): mlx-lm's text-only model (its `sanitize`
  drops the vision weights), whose logits on text-only prompts equal mlx-vlm's language
  model's: `mx.allclose(a, b, atol=1e-4, rtol=1e-4)` in float32 (qwen3_5's two GatedDeltaNet
  implementations differ by ~5e-5, the other families by <= 3e-6; mx.allclose's default
  atol 1e-8 is too tight for logits near 0).

Weights: mlx-vlm's model class is built from the config under a fixed `mx.random.seed` and its
own parameters are saved (float32, mlx-vlm's names: `vision_tower.*`, `language_model.model.*`,
`language_model.lm_head.*`, `multi_modal_projector.*`, `embed_vision.*`); both loaders'
`sanitize` keep these names as they are (checked: every saved tensor loads back unchanged). A
few parameters are rescaled so that greedy output varies and depends on the image (`_tweak`).
The tokenizer is a small byte-level BPE trained here with the family's special tokens (first,
ids 0..); the ids in config.json are the tokenizer's, and the model's vocabulary is exactly the
tokenizer's size (so any id a random model emits decodes). Nothing is downloaded.

Sizes: text hidden 64, 2-4 layers, 4 heads (2 KV heads), head_dim 16; vision towers of 2
layers, hidden 32, patch 8; a 64x64 image is 16 image tokens in every family (see `NOTES`).

Not imported by the package; needs mlx-vlm and mlx-lm (and `tokenizers`, transformers, PIL).
Per-family notes: `NOTES` at the bottom of this file.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

HIDDEN = 64
MAX_SIDE = 96         # Qwen / Pixtral: larger images are shrunk to fit 96x96 px (36 tokens)
BPE_VOCAB = 320       # the trained BPE's size, special tokens included; the model's vocabulary
                      # is the tokenizer's size (a random model may emit any id: all decode)
# Untied families (Qwen, Mistral 3): the text attention's q/k projections scaled up (sharper
# attention: the output depends on the context, the image included; no effect where q and k
# are RMS-normed, as in qwen3_vl / qwen3_5). Token embeddings are left as initialised: scaled up
# (x4) the current token dominated and outputs hardly depended on the image or prompt.
QK_SCALE = 3.0
EMBED_SCALE = 1.0

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "for i in range(10):\n    print(i * i)\n",
    "Hello! How can I help you today? I am a small assistant.",
    "Describe this image. What is in the picture? A cat, a dog and a red ball.",
    "user\nassistant\nsystem\n",
] * 4

# ----------------------------------------------------------------------------- tokenizers

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                 "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
                 "<think>", "</think>"]
GEMMA3_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>",
                   "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
GEMMA4_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>", "<|image>",
                   "<image|>", "<|image|>", "<|audio>", "<audio|>", "<|audio|>", "<|video|>",
                   "<|channel>", "<channel|>", "<|think|>"]
PIXTRAL_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]",
                    "[IMG_END]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "<pad>"]

# Chat templates, in small, placing the image the way the family's real template does.
QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PIXTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set text = namespace(s='') %}{% for block in message['content'] %}"
    "{% if block['type'] == 'text' %}{% set text.s = text.s + block['text'] %}"
    "{% elif block['type'] in ['image', 'image_url'] %}{% set text.s = text.s + '[IMG]' %}"
    "{% endif %}{% endfor %}{% set text = text.s %}{% endif %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{{ text }}[/INST]"
    "{% elif message['role'] == 'assistant' %}{{ text }}{{ eos_token }}"
    "{% endif %}{% endfor %}"
)
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "<start_of_turn>{{ role }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
GEMMA4_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "<|turn>{{ role }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|image|>"
    "{% elif item['type'] == 'video' %}<|video|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


def _write_tokenizer(folder: Path, specials: list[str], tokenizer_config: dict) -> dict:
    """A byte-level BPE (tokenizer.json) with `specials` first (ids 0..); returns name -> id,
    and the vocabulary size under "<vocab_size>"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096,
           "clean_up_tokenization_spaces": False}
    cfg.update(tokenizer_config)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    ids = {s: tok.token_to_id(s) for s in specials}
    ids["<vocab_size>"] = tok.get_vocab_size()
    return ids


# ----------------------------------------------------------------------------- configs

def _qwen_vl_processor_files(folder: Path, family: str, patch: int, merge: int) -> None:
    """preprocessor_config.json (+ video_preprocessor_config.json): a 64x64 image is 8x8
    patches of 8 px, merged 2x2 into 16 image tokens; images are kept within 96x96 px
    (36 tokens at most) and at least 16x16 (1 token)."""
    processor = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}.get(
        family, "Qwen3VLProcessor")
    pre = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": processor,
           "patch_size": patch, "temporal_patch_size": 2, "merge_size": merge,
           "min_pixels": (patch * merge) ** 2, "max_pixels": MAX_SIDE * MAX_SIDE,
           "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
           "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
           "do_convert_rgb": True}
    (folder / "preprocessor_config.json").write_text(json.dumps(pre, indent=1))
    if family != "qwen2_vl":      # qwen2_vl keeps its video settings in the file above
        vid = dict(pre, video_processor_type="Qwen3VLVideoProcessor", fps=2.0, min_frames=2,
                   max_frames=8, size={"shortest_edge": (patch * merge) ** 2,
                                       "longest_edge": 4 * MAX_SIDE * MAX_SIDE})
        del vid["image_processor_type"]
        (folder / "video_preprocessor_config.json").write_text(json.dumps(vid, indent=1))


def _qwen(folder: Path, family: str) -> dict:
    ids = _write_tokenizer(folder, QWEN_SPECIALS, {
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": QWEN_TEMPLATE})
    common = {"image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
              "vision_start_token_id": ids["<|vision_start|>"],
              "vision_end_token_id": ids["<|vision_end|>"],
              "vision_token_id": ids["<|vision_pad|>"],
              "eos_token_id": ids["<|im_end|>"], "bos_token_id": ids["<|endoftext|>"],
              "pad_token_id": ids["<|endoftext|>"]}
    text = {"hidden_size": HIDDEN, "num_hidden_layers": 2, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
            "vocab_size": ids["<vocab_size>"], "max_position_embeddings": 4096,
            "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu"}
    patch, merge = 8, 2
    if family in ("qwen2_vl", "qwen2_5_vl"):
        # head_dim 16: mrope_section sums to head_dim / 2.
        text.update(rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
                    use_sliding_window=False, sliding_window=4096)
        if family == "qwen2_vl":
            vision = {"model_type": "qwen2_vl", "depth": 2, "embed_dim": 32,
                      "hidden_size": HIDDEN, "num_heads": 2, "mlp_ratio": 2,
                      "patch_size": patch, "spatial_patch_size": patch,
                      "spatial_merge_size": merge, "temporal_patch_size": 2,
                      "in_channels": 3}
        else:
            # window 32 px = 2x2 merged tokens per window; block 1 attends over the whole image
            vision = {"model_type": "qwen2_5_vl", "depth": 2, "hidden_size": 32,
                      "intermediate_size": 64, "out_hidden_size": HIDDEN, "num_heads": 2,
                      "patch_size": patch, "spatial_patch_size": patch,
                      "spatial_merge_size": merge, "temporal_patch_size": 2,
                      "window_size": 32, "fullatt_block_indexes": [1],
                      "tokens_per_second": 2, "in_channels": 3, "hidden_act": "silu"}
        cfg = {"model_type": family, **text, **common,
               "text_config": {"model_type": family, **text, **common},
               "vision_config": vision}
    elif family == "qwen3_vl":
        text.update(head_dim=16, attention_bias=False,
                    rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3],
                                  "mrope_interleaved": True})
        vision = {"model_type": "qwen3_vl", "depth": 2, "hidden_size": 32,
                  "intermediate_size": 64, "out_hidden_size": HIDDEN, "num_heads": 2,
                  "patch_size": patch, "spatial_merge_size": merge, "temporal_patch_size": 2,
                  "num_position_embeddings": 16, "deepstack_visual_indexes": [0],
                  "in_channels": 3, "hidden_act": "gelu_pytorch_tanh"}
        cfg = {"model_type": family, **common,
               "text_config": {"model_type": "qwen3_vl_text", **text, **common},
               "vision_config": vision, "tie_word_embeddings": False}
    elif family in ("qwen3_5", "qwen3_5_moe"):
        # 4 layers: linear (GatedDeltaNet), linear, linear, full attention; the MoE variant
        # (Qwen3.5/3.6's A3B models) with 4 experts, 2 a token, and a shared expert.
        text.update(num_hidden_layers=4, head_dim=16, attention_bias=False,
                    linear_num_value_heads=4, linear_num_key_heads=2,
                    linear_key_head_dim=16, linear_value_head_dim=16,
                    linear_conv_kernel_dim=4, full_attention_interval=4,
                    layer_types=["linear_attention"] * 3 + ["full_attention"],
                    rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1],
                                     "mrope_interleaved": True, "rope_theta": 10000.0,
                                     "partial_rotary_factor": 0.5})
        if family == "qwen3_5_moe":
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=64, norm_topk_prob=True,
                        decoder_sparse_step=1, mlp_only_layers=[])
        vision = {"model_type": family, "depth": 2, "hidden_size": 32,
                  "intermediate_size": 64, "out_hidden_size": HIDDEN, "num_heads": 2,
                  "patch_size": patch, "spatial_merge_size": merge, "temporal_patch_size": 2,
                  "num_position_embeddings": 16, "deepstack_visual_indexes": [],
                  "in_channels": 3, "hidden_act": "gelu_pytorch_tanh"}
        cfg = {"model_type": family, **common,
               "text_config": {"model_type": f"{family}_text", **text, **common},
               "vision_config": vision, "tie_word_embeddings": False}
    else:
        raise ValueError(family)
    _qwen_vl_processor_files(folder, family, patch, merge)
    return cfg


def _mistral3(folder: Path, family: str) -> dict:
    ids = _write_tokenizer(folder, PIXTRAL_SPECIALS, {
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
        "chat_template": PIXTRAL_TEMPLATE})
    patch, merge = 8, 2
    text = {"model_type": "mistral", "hidden_size": HIDDEN, "num_hidden_layers": 2,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "rms_norm_eps": 1e-5, "vocab_size": ids["<vocab_size>"],
            "max_position_embeddings": 4096, "rope_theta": 10000.0, "sliding_window": None,
            "hidden_act": "silu", "tie_word_embeddings": False}
    vision = {"model_type": "pixtral", "num_hidden_layers": 2, "hidden_size": 32,
              "head_dim": 16, "intermediate_size": 64, "num_attention_heads": 2,
              "image_size": MAX_SIDE, "patch_size": patch, "num_channels": 3,
              "rope_theta": 10000.0,
              "hidden_act": "silu"}
    cfg = {"model_type": "mistral3", "architectures": ["Mistral3ForConditionalGeneration"],
           "image_token_index": ids["[IMG]"], "multimodal_projector_bias": False,
           "projector_hidden_act": "gelu", "spatial_merge_size": merge,
           "vision_feature_layer": -1, "text_config": text, "vision_config": vision,
           "bos_token_id": ids["<s>"], "eos_token_id": ids["</s>"],
           "pad_token_id": ids["<pad>"]}
    # 64x64 -> 8x8 patches of 8 -> 4x4 merged tokens: 4 rows of 4 [IMG], [IMG_BREAK] between
    # rows, [IMG_END] last (20 tokens); images larger than 96 px a side are shrunk to fit.
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "PixtralImageProcessor",
        "patch_size": {"height": patch, "width": patch}, "size": {"longest_edge": MAX_SIDE},
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], "do_resize": True,
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "do_convert_rgb": True, "resample": 3}, indent=1))
    (folder / "processor_config.json").write_text(json.dumps({
        "processor_class": "PixtralProcessor", "image_token": "[IMG]",
        "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]",
        "patch_size": patch, "spatial_merge_size": merge}, indent=1))
    return cfg


def _gemma3(folder: Path, family: str) -> dict:
    ids = _write_tokenizer(folder, GEMMA3_SPECIALS, {
        "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>",
        "chat_template": GEMMA3_TEMPLATE,
        "extra_special_tokens": {"boi_token": "<start_of_image>",
                                 "eoi_token": "<end_of_image>",
                                 "image_token": "<image_soft_token>"}})
    patch, image, tokens = 8, 64, 16          # 8x8 patches, pooled 2x2 -> 16 soft tokens
    vocab = ids["<vocab_size>"]
    # 4 layers, sliding_window_pattern 2: layers 0, 2 sliding (window 512), 1, 3 global.
    text = {"model_type": "gemma3_text", "hidden_size": HIDDEN, "num_hidden_layers": 4,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": vocab,
            "rope_theta": 1_000_000.0, "rope_global_base_freq": 1_000_000.0,
            "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 16,
            "sliding_window": 512, "sliding_window_pattern": 2,
            "max_position_embeddings": 4096, "mm_tokens_per_image": tokens,
            "hidden_activation": "gelu_pytorch_tanh", "rope_scaling": None,
            "final_logit_softcapping": None, "attn_logit_softcapping": None}
    vision = {"model_type": "siglip_vision_model", "num_hidden_layers": 2, "hidden_size": 32,
              "intermediate_size": 64, "num_attention_heads": 2, "patch_size": patch,
              "image_size": image, "num_channels": 3, "layer_norm_eps": 1e-6,
              "vision_use_head": False}
    cfg = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
           "text_config": text, "vision_config": vision, "mm_tokens_per_image": tokens,
           "image_token_index": ids["<image_soft_token>"],
           "boi_token_index": ids["<start_of_image>"],
           "eoi_token_index": ids["<end_of_image>"],
           "hidden_size": HIDDEN, "vocab_size": vocab, "pad_token_id": ids["<pad>"],
           "bos_token_id": ids["<bos>"], "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]]}
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
        "size": {"height": image, "width": image}, "image_seq_length": tokens,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_resize": True,
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "do_convert_rgb": None, "do_pan_and_scan": None, "resample": 2}, indent=1))
    (folder / "processor_config.json").write_text(json.dumps({
        "processor_class": "Gemma3Processor", "image_seq_length": tokens}, indent=1))
    return cfg


def _gemma4(folder: Path, family: str) -> dict:
    ids = _write_tokenizer(folder, GEMMA4_SPECIALS, {
        "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>",
        "chat_template": GEMMA4_TEMPLATE,
        "extra_special_tokens": {"boi_token": "<|image>", "eoi_token": "<image|>",
                                 "image_token": "<|image|>", "boa_token": "<|audio>",
                                 "eoa_token": "<audio|>", "audio_token": "<|audio|>",
                                 "video_token": "<|video|>"}})
    patch, pool, tokens = 8, 2, 16       # 64x64 -> 8x8 patches, pooled 2x2 -> 16 soft tokens
    vocab = ids["<vocab_size>"]
    # Gemma 4 "E2B"-like: per-layer inputs, the last 2 of 4 layers share the KV of the last
    # earlier layer of their type, double-wide MLP there; layers alternate sliding / full.
    text = {"model_type": "gemma4_text", "hidden_size": HIDDEN, "num_hidden_layers": 4,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "global_head_dim": 32, "global_partial_rotary_factor": 0.25,
            "rms_norm_eps": 1e-6, "vocab_size": vocab, "vocab_size_per_layer_input": vocab,
            "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 16,
            "use_double_wide_mlp": True, "sliding_window": 512, "sliding_window_pattern": 2,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "rope_parameters": {
                "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0,
                                   "rope_type": "proportional"},
                "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10_000.0,
                                      "rope_type": "default"}},
            "max_position_embeddings": 4096, "final_logit_softcapping": 30.0,
            "hidden_activation": "gelu_pytorch_tanh", "attention_k_eq_v": False,
            "use_bidirectional_attention": "vision", "enable_moe_block": False,
            "tie_word_embeddings": True, "pad_token_id": ids["<pad>"]}
    vision = {"model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
              "head_dim": 16, "global_head_dim": 16, "rms_norm_eps": 1e-6,
              "patch_size": patch, "pooling_kernel_size": pool,
              "position_embedding_size": 64, "default_output_length": tokens,
              "rope_parameters": {"rope_theta": 100.0, "rope_type": "default"},
              "use_clipped_linears": False, "standardize": False,
              "hidden_activation": "gelu_pytorch_tanh"}
    cfg = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
           "text_config": text, "vision_config": vision, "audio_config": None,
           "image_token_id": ids["<|image|>"], "audio_token_id": ids["<|audio|>"],
           "video_token_id": ids["<|video|>"], "boi_token_id": ids["<|image>"],
           "eoi_token_id": ids["<image|>"], "boa_token_id": ids["<|audio>"],
           "eoa_token_id": ids["<audio|>"], "vision_soft_tokens_per_image": tokens,
           "hidden_size": HIDDEN, "vocab_size": vocab, "pad_token_id": ids["<pad>"],
           "bos_token_id": ids["<bos>"], "eos_token_id": [ids["<eos>"], ids["<turn|>"]],
           "tie_word_embeddings": True}
    image_processor = {"image_processor_type": "Gemma4ImageProcessor", "patch_size": patch,
                       "max_soft_tokens": tokens, "pooling_kernel_size": pool,
                       "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
                       "do_normalize": False, "image_mean": [0.0, 0.0, 0.0],
                       "image_std": [1.0, 1.0, 1.0]}
    (folder / "processor_config.json").write_text(json.dumps({
        "processor_class": "Gemma4Processor", "image_seq_length": tokens,
        "image_processor": image_processor}, indent=1))
    return cfg


_BUILDERS = {"qwen2_vl": _qwen, "qwen2_5_vl": _qwen, "qwen3_vl": _qwen, "qwen3_5": _qwen,
             "qwen3_5_moe": _qwen,
             "mistral3": _mistral3, "gemma3": _gemma3, "gemma4": _gemma4}


# ----------------------------------------------------------------------------- weights

def _vlm_model(cfg: dict, seed: int):
    """mlx-vlm's model class for `cfg`, built the way mlx_vlm.utils.load_model builds it."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    config = copy.deepcopy(cfg)
    model_class, _ = get_model_and_args(config)
    config.setdefault("text_config", {})
    config.setdefault("vision_config", {})
    config.setdefault("audio_config", {})
    model_config = model_class.ModelConfig.from_dict(config)
    model_config = update_module_configs(model_config, model_class, config,
                                         ["text", "vision", "perceiver", "projector", "audio"])
    mx.random.seed(seed)
    return model_class.Model(model_config)


# Qwen: the vision merger's output layers scaled up (x3) so that image features weigh more than
# the text embeddings: greedy output then depends on the image.
_PROJECTOR_OUT = ("merger.mlp.2.", "merger.linear_fc2.", "deepstack_merger_list.")


def _tweak(family: str, params: dict, seed: int) -> dict:
    """Family-specific changes to the freshly built parameters (see the notes at the bottom)."""
    if family in ("gemma3", "gemma4"):
        # Tied head (mlx-vlm's gemma sanitize always ties it): no lm_head in the file, and no
        # embedding scale-up (a tied random model then just repeats its input token); the
        # layers' post-norms are scaled up instead so that the layers move the residual.
        params.pop("language_model.lm_head.weight", None)
        params = {k: (mx.full(v.shape, 3.0, v.dtype) if k.endswith(
                      ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight"))
                      else v) for k, v in params.items()}
        # initialised to ones by mlx-vlm (every image token would get the same feature /
        # every patch the same position embedding): random instead
        key = ("multi_modal_projector.mm_input_projection_weight" if family == "gemma3" else
               "vision_tower.patch_embedder.position_embedding_table")
        w = params[key]
        params[key] = mx.random.normal(w.shape, key=mx.random.key(seed + 1)) * w.shape[-2] ** -0.5
        return params
    return {k: (v * 3.0 if any(p in k for p in _PROJECTOR_OUT) else
                v * EMBED_SCALE if k.endswith("embed_tokens.weight") else
                v * QK_SCALE if k.startswith("language_model.") and ".self_attn." in k
                and (".q_proj." in k or ".k_proj." in k) else v)
            for k, v in params.items()}


def _write_weights(folder: Path, family: str, cfg: dict, seed: int) -> None:
    model = _vlm_model(cfg, seed)
    params = _tweak(family, dict(tree_flatten(model.parameters())), seed)
    params = {k: v.astype(mx.float32) for k, v in params.items()}
    mx.save_safetensors(str(folder / "model.safetensors"), params,
                        metadata={"format": "mlx"})


# ----------------------------------------------------------------------------- public API

def write_vlm(folder: Path, family: str, seed: int = 0,
              text_overrides: dict | None = None) -> Path:
    """A tiny random-weight `family` VLM folder (one of `FAMILIES`) that mlx_vlm.load and
    mlx_lm.utils.load both open. `seed` picks the weights; `text_overrides`: text-config keys
    to change (e.g. {"sliding_window": 16} for gemma3/gemma4), written wherever the family
    keeps its text config."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = _BUILDERS[family](folder, family)
    if text_overrides:
        cfg["text_config"].update(text_overrides)
        if family in ("qwen2_vl", "qwen2_5_vl"):      # mlx-vlm reads these at the top level
            cfg.update(text_overrides)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    _write_weights(folder, family, cfg, seed)
    return folder


def test_image(seed: int = 0, size: tuple[int, int] = (64, 64)):
    """A PIL RGB image of random pixels (size = (width, height))."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


test_image.__test__ = False    # not a pytest test


def vlm_greedy(folder, messages_or_prompt, images=(), max_tokens: int = 8,
               loaded=None) -> list[int]:
    """mlx-vlm's own greedy generation (token ids), through its public processing path:
    `mlx_vlm.prompt_utils.apply_chat_template(processor, model.config, messages_or_prompt,
    num_images=len(images))` (a prompt string, or a message list whose user content may hold
    {"type": "image"} parts; images without a part are placed where the family's mlx-vlm
    message format puts them), then `mlx_vlm.generate(model, processor, prompt, image=images,
    max_tokens=..., temperature=0.0)`, which runs the processor (image placeholders expanded),
    the vision tower and the language model. `images`: PIL images (or paths).

    Returns `GenerationResult.token_ids`: at most `max_tokens` ids; when an EOS id ends the
    generation early it is the last id returned. `loaded`: an already loaded
    (model, processor) pair, to skip the load (generation state does not leak between calls:
    the prompt's position ids / rope deltas are recomputed each call)."""
    from mlx_vlm import generate, load
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = loaded if loaded is not None else load(str(folder))
    images = list(images or [])
    prompt = apply_chat_template(processor, model.config, messages_or_prompt,
                                 num_images=len(images))
    result = generate(model, processor, prompt, image=images or None,
                      max_tokens=max_tokens, temperature=0.0, verbose=False)
    return [int(t) for t in (result.token_ids or [])]


FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe", "mistral3", "gemma3",
            "gemma4")


NOTES = """\
What the fixtures showed about mlx-vlm 0.7.10 / mlx-lm 0.32.2 (checked with these folders).

Common to all families
- Loading: mlx_vlm.load / mlx_vlm.utils.load imports mlx_vlm.models.<model_type>, which installs
  its processor as a patch on transformers.AutoProcessor.from_pretrained; the patch swallows
  any exception and falls back to transformers' own AutoProcessor, so an error in the family's
  processor surfaces as whatever the fallback raises. transformers 5 validates config.json
  strictly when AutoTokenizer reads it (qwen2_vl's vision mlp_ratio must be an int, not 2.0).
  Both loaders call the model's `sanitize`; saving mlx-vlm's own parameter names round-trips
  exactly in every family (mlx-lm keeps language_model.*, drops the rest).
- Generation: mlx_vlm.generate -> stream_generate -> prepare_inputs(processor, images, prompt)
  -> generate_step: one `model.get_input_embeddings(input_ids, pixel_values, mask=attention_mask,
  **processor_extras)` call, then `model.language_model(input_ids, inputs_embeds=...,
  cache=cache, **processor_extras, **other_features)` for the prompt (chunked when long), then
  `model.language_model(next_id[None], cache=cache)` per token. Doing exactly this by hand
  reproduces vlm_greedy's tokens in every family. processor_extras: the processor's outputs
  other than input_ids / pixel_values / attention_mask (below); other_features: the
  non-None fields of the returned InputEmbeddingsFeatures other than inputs_embeds.
- A 64x64 image is 16 image tokens in every family here (see each for other sizes).
- vlm_greedy's ids end with the EOS id when one stops generation (GenerationResult.token_ids).

qwen2_vl
- Processor: mlx_vlm.models.qwen2_vl.processing_qwen2_vl.Qwen2VLProcessor, with the torch-free
  Qwen3VLImageProcessor / Qwen3VLVideoProcessor (mlx_vlm.models.qwen3_vl.processing_qwen3_vl),
  configured from preprocessor_config.json (patch_size, merge_size, temporal_patch_size,
  min_pixels / max_pixels, mean / std). mlx-vlm puts the image after the text (message format
  LIST_WITH_IMAGE); the other Qwen families put it first.
- 64x64 (or 56x56, rounded to 64) -> image_grid_thw [[1, 8, 8]], pixel_values (64, 384)
  (flattened 2x8x8x3 patches) -> 16 x <|image_pad|> between <|vision_start|> and
  <|vision_end|>; 96x64 -> 24, 32x32 -> 4; larger images are shrunk to <= 96x96 px (36).
  Image token: config image_token_id = id of "<|image_pad|>" (video: <|video_pad|>).
- Multimodal RoPE: yes (rope_scaling mrope_section [2, 3, 3], "chunked" sections of head_dim/2).
  position_ids [3, B, T]: text tokens count 0, 1, ... on all three rows; the image block starts
  at the next index s and has t = s, h = s + row, w = s + col (merged grid 4x4); text after it
  continues at max + 1. rope_deltas [B, 1] = max position + 1 - T (-12 for the 38-token
  prompt "...Describe this image.<image>..."; 0 without an image). In decode the language
  model uses position = cache offset + its stored `_rope_deltas` (set by the prompt call).
- Attention: causal everywhere (the vision tower attends over each whole image).
- Merged embeddings: feats = model.get_input_embeddings(input_ids, pixel_values,
  image_grid_thw=grid, mask=attention_mask) -> InputEmbeddingsFeatures(inputs_embeds [B, T, 64],
  position_ids [3, B, T], rope_deltas [B, 1]); then model.language_model(input_ids,
  inputs_embeds=feats.inputs_embeds, cache=cache, image_grid_thw=grid,
  position_ids=feats.position_ids, rope_deltas=feats.rope_deltas) -> LanguageModelOutput(logits).
- Text: mlx-vlm reads the text config from the top level of config.json (its from_dict copies
  the top level into text_config), mlx-lm from text_config (qwen2_vl -> qwen2 text model):
  the fixture writes both. q/k/v have biases.

qwen2_5_vl
- Processor: Qwen2_5_VLProcessor (mlx_vlm.models.qwen2_5_vl.processing_qwen2_5_vl), same image
  processor, same token counts, image token, mRoPE (chunked, [2, 3, 3]), position ids /
  rope_deltas and get_input_embeddings call as qwen2_vl (mlx-lm maps qwen2_5_vl to qwen2_vl).
- Vision tower: RMSNorm + SwiGLU blocks; block 0 uses window attention (window_size 32 px =
  2x2 merged tokens, the patches reordered by window), block 1 full attention
  (fullatt_block_indexes [1]).

qwen3_vl
- Processor: Qwen3VLProcessor; same image processor and token counts (16 for 64x64).
- Multimodal RoPE: yes, "interleaved" sections ([2, 3, 3]); same position_ids / rope_deltas.
  Text: q_norm / k_norm, head_dim 16, config in text_config (model_type qwen3_vl_text);
  mlx-lm's qwen3_vl is the qwen3 text model.
- DeepStack (deepstack_visual_indexes [0] here, as real checkpoints have): get_input_embeddings
  (same call as qwen2_vl) returns inputs_embeds, position_ids, rope_deltas and also
  visual_pos_masks [B, T] (bool: image/video positions) and deepstack_visual_embeds (a list, one
  [n_image_tokens, 64] array per deepstack layer); the language model adds entry i to the hidden
  states at the visual positions after text layer i, so both must be passed to
  model.language_model(...) with the embeddings. Causal attention.

qwen3_5
- Processor: Qwen3VLProcessor (installed for model_type qwen3_5); vision tower = qwen3_vl's
  without DeepStack; 16 image tokens for 64x64.
- Text (text_config model_type qwen3_5_text): layers 0-2 GatedDeltaNet (linear attention,
  ArraysCache(2) each: conv state + recurrent state), layer 3 full attention (gated output,
  q_norm / k_norm, partial rotary 0.5: 8 of 16 dims). Multimodal RoPE: yes, interleaved,
  mrope_section [2, 1, 1] (rope_parameters); same position_ids [3, B, T] / rope_deltas.
- Merged embeddings: get_input_embeddings(input_ids, pixel_values, image_grid_thw=grid,
  mask=attention_mask) -> inputs_embeds, position_ids, rope_deltas. Causal.
- Norm weights: both sanitizers add 1 to RMSNorm weights only for checkpoints in the HF layout
  (conv1d weights not yet [C, K, 1], or MTP weights): the saved MLX-layout weights are kept.

mistral3
- Processor: mlx_vlm.models.mistral3.processing_mistral3.Mistral3Processor with mlx-vlm's numpy
  PixtralImageProcessor (preprocessor_config.json: patch 8, longest_edge 96; processor_config
  .json: spatial_merge_size 2 and the [IMG] token names). The prompt's single [IMG] expands to
  rows of [IMG] x (W/16) separated by [IMG_BREAK], then [IMG_END]: 64x64 -> 16 [IMG] + 3
  [IMG_BREAK] + 1 [IMG_END] (20 tokens; only the [IMG] positions get image features). 96x64 ->
  24 [IMG]; 200x100 -> 96x48 -> 18. pixel_values [B, 3, H, W] (channel first, zero-padded to the
  batch's largest), image_sizes [[H, W]]. Image token: config image_token_index = id of [IMG].
- RoPE: plain 1-D (text model_type "mistral": mlx-vlm's pixtral Mistral, mlx-lm's llama).
  Causal. Vision: Pixtral (2-D RoPE over patch rows / columns); projector RMSNorm -> 2x2 patch
  merger (unfold + linear) -> linear, GELU, linear.
- Merged embeddings: model.get_input_embeddings(input_ids, pixel_values, image_sizes=sizes) ->
  InputEmbeddingsFeatures(inputs_embeds) only; model.language_model(input_ids,
  inputs_embeds=..., cache=cache).

gemma3
- Processor: mlx_vlm.models.gemma3.processing_gemma3.Gemma3Processor with transformers'
  Gemma3ImageProcessor (torchvision absent: Gemma3ImageProcessorPil), which resizes every image
  to 64x64: always 16 image tokens (mm_tokens_per_image; SigLIP 8x8 patches average-pooled 2x2).
  The prompt's "<start_of_image>" becomes "\\n\\n<start_of_image>" + 16 x "<image_soft_token>" +
  "<end_of_image>\\n\\n". Image token: config image_token_index = id of "<image_soft_token>";
  tokenizer_config.json's extra_special_tokens (boi_token, eoi_token, image_token) give the
  tokenizer the attributes the processor needs.
- RoPE: 1-D (global layers theta 1e6, sliding layers 1e4); layers alternate sliding (window
  512) / global here (sliding_window_pattern 2). Attention: causal, image tokens included, in
  mlx-vlm: get_input_embeddings returns an attention_mask_4d, but it is only the padding mask's
  outer product (all ones here) and generation ignores it (HF's Gemma 3 attends
  bidirectionally within an image; mlx-vlm does not).
- Merged embeddings: model.get_input_embeddings(input_ids, pixel_values,
  mask=attention_mask) -> inputs_embeds (text rows: raw embeddings; image rows: projector
  output / sqrt(hidden), since the language model multiplies all inputs_embeds by
  sqrt(hidden)), attention_mask_4d. Gotcha: Gemma3Model does `h *= sqrt(hidden)` in place,
  so calling language_model twice on the same inputs_embeds array scales it twice (copy it).
- Head tied to embed_tokens: mlx-vlm's gemma3 sanitize always sets lm_head from embed_tokens,
  so the file has no lm_head (as real checkpoints); mlx-lm ties it too. mlx-lm reads the
  vocabulary size from the top level (default 262208), so config.json has it there.

gemma4
- Processor: mlx_vlm.models.gemma4.processing_gemma4.Gemma4Processor with its numpy
  Gemma4ImageProcessor, configured from processor_config.json's "image_processor" (patch 8,
  pooling 2, max_soft_tokens 16): aspect-preserving resize filling <= 16 soft tokens (sides
  multiples of 16 px): 64x64 and 32x32 -> 16, 96x64 -> 12, 200x100 -> 10. The prompt's
  "<|image|>" becomes "<|image>" + n x "<|image|>" + "<image|>". The processor also returns
  mm_token_type_ids (1 on image tokens). Image token: config image_token_id = id of
  "<|image|>". (Its audio feature extractor warns about mel filters on load: harmless.)
- RoPE: 1-D (full layers: proportional, partial 0.25 of global_head_dim 32, theta 1e6;
  sliding layers: default, theta 1e4). Attention: bidirectional within each image block — with
  text_config.use_bidirectional_attention == "vision" (set here, as real checkpoints) and
  mm_token_type_ids passed to the language model, the prompt's masks let each contiguous image
  block attend to itself (logits change by ~4 without it); causal otherwise.
- Text here "E2B"-like: per-layer inputs (hidden_size_per_layer_input 16), layers 2-3 reuse
  the KV of layers 0-1 (num_kv_shared_layers 2; make_cache returns 2 caches), double-wide MLP
  on shared layers, final logit soft-cap 30, head tied to embed_tokens.
- Merged embeddings: feats = model.get_input_embeddings(input_ids, pixel_values) ->
  inputs_embeds (text rows already x sqrt(hidden); image rows = embed_vision(vision_tower(...)),
  not scaled) and per_layer_inputs [B, T, n_layers, 16] (per-layer embeddings of the token
  ids, image positions looked up as id 0); then model.language_model(input_ids,
  inputs_embeds=feats.inputs_embeds, per_layer_inputs=feats.per_layer_inputs,
  mm_token_type_ids=mm_token_type_ids, cache=cache). Decode: language_model(ids, cache=cache).
"""
