"""Llama-architecture `.gguf` files as an mlx-lm llama model plus an mlx-lm tokenizer.

    model, tokenizer = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")

MLX reads GGUF itself (`mx.load(path, return_metadata=True)`): F32/F16 tensors come back as plain
arrays, Q4_0/Q4_1/Q8_0 ones as MLX affine-quantized triples (`weight` uint32, `scales`,
`biases`) with group size 32. We keep those quantized (`nn.QuantizedLinear` /
`nn.QuantizedEmbedding` with each tensor's own bit width); `checkpoint.load_target(..., dtype=...)`
dequantizes afterwards when asked.

Conventions of llama.cpp that matter here:

- tensor names: `token_embd`, `blk.{i}.attn_{q,k,v,output}`, `blk.{i}.ffn_{gate,up,down}`,
  `blk.{i}.attn_norm`, `blk.{i}.ffn_norm`, `output_norm`, and `output` (absent when the
  embeddings are tied);
- llama.cpp's converter permutes the q/k rows into its rotary layout (pairs of adjacent
  channels), which is what mlx-lm's `rope_traditional=True` rotates: no un-permuting needed;
- the tokenizer lives in metadata: `tokenizer.ggml.tokens` (already spelled in the byte-level
  alphabet, e.g. "Ġthe"), `tokenizer.ggml.merges` ("Ġ t"), `tokenizer.ggml.token_type`
  (3 = CONTROL: special tokens matched whole), `tokenizer.ggml.pre` (the pre-tokenizer name).

The functions below are small and pure where they can be (`model_args`, `gguf_to_mlx_name`,
`map_weights`, `quantization_plan`, `build_tokenizer`), so each can be tested on its own.
"""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .weights import mismatches

ARCHITECTURE = "llama"
GROUP_SIZE = 32  # every quantized GGUF type MLX loads (Q4_0, Q4_1, Q8_0) uses blocks of 32
SUPPORTED_BITS = (4, 8)

# llama.cpp token types (llama_token_type / gguf TokenType).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 2, 3, 4

# GGUF module names -> mlx-lm llama module paths.
TOP_MODULES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
               "output": "lm_head"}
BLOCK_MODULES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Tensor suffixes: `weight`/`bias` of the layer, `scales`/`biases` of MLX's quantization.
SUFFIXES = ("weight", "bias", "scales", "biases")
BLOCK_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.([a-z]+)$")

# Byte-level BPE pre-tokenizers, by `tokenizer.ggml.pre` (llama.cpp's names). "gpt2": GPT-2's
# split regex (what ByteLevel(use_regex=True) applies); "digits": every digit on its own first
# (llama.cpp: "\p{N}" then the GPT-2 regex; HF: Digits(individual_digits=True) + ByteLevel);
# "llama3": the Llama 3 regex, then ByteLevel without its own regex.
PRE_TOKENIZERS = {
    "default": "gpt2", "gpt2": "gpt2", "mpt": "gpt2", "olmo": "gpt2", "jais": "gpt2",
    "smollm": "digits", "starcoder": "digits", "refact": "digits", "command-r": "digits",
    "codeshell": "digits", "exaone": "digits", "minerva": "digits",
    "llama-bpe": "llama3", "llama3": "llama3", "llama-v3": "llama3", "smaug-bpe": "llama3",
    "falcon3": "llama3", "dbrx": "llama3",
}
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


# ----------------------------------------------------------------------------- reading


def read_gguf(path: str | Path) -> tuple[dict[str, mx.array], dict]:
    """(tensors, metadata) as MLX reads them; a ValueError naming the file if it cannot."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file '{path}': no such file")
    try:
        tensors, metadata = mx.load(str(path), format="gguf", return_metadata=True)
    except (RuntimeError, ValueError, OSError) as e:
        raise ValueError(f"{path}: not a GGUF file MLX can read ({e})") from e
    return tensors, metadata


def _value(metadata: dict, key: str, source: str, default=...):
    """A metadata value as a Python object (MLX returns numbers as 0-d/1-d arrays)."""
    if key not in metadata:
        if default is ...:
            raise ValueError(f"{source}: missing GGUF metadata key '{key}'")
        return default
    value = metadata[key]
    if isinstance(value, mx.array):
        value = value.item() if value.ndim == 0 else value.tolist()
    return value


def _int(metadata: dict, key: str, source: str, default=...):
    value = _value(metadata, key, source, default)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"{source}: metadata '{key}' differs per layer ({value}); "
                             "not supported")
        value = value[0]
    return value if value is None else int(value)


def check_architecture(metadata: dict, source: str) -> None:
    arch = _value(metadata, "general.architecture", source)
    if arch != ARCHITECTURE:
        raise ValueError(f"{source}: unsupported architecture '{arch}' "
                         f"(metadata 'general.architecture'); only '{ARCHITECTURE}' GGUF files "
                         "are supported")


# ----------------------------------------------------------------------------- model


def model_args(metadata: dict, tensor_names=(), source: str = "<gguf>"):
    """mlx-lm llama `ModelArgs` from `llama.*` metadata (and which optional tensors exist)."""
    from mlx_lm.models.llama import ModelArgs

    check_architecture(metadata, source)
    p = ARCHITECTURE + "."
    hidden = _int(metadata, p + "embedding_length", source)
    heads = _int(metadata, p + "attention.head_count", source)
    head_dim = _int(metadata, p + "attention.key_length", source, None) or hidden // heads
    rope_dims = _int(metadata, p + "rope.dimension_count", source, None)
    if rope_dims is not None and rope_dims != head_dim:
        raise ValueError(f"{source}: partial rotary embeddings ('{p}rope.dimension_count' = "
                         f"{rope_dims}, head dim {head_dim}) are not supported")
    rope_scaling = None
    scaling = _value(metadata, p + "rope.scaling.type", source, "none")
    if scaling == "linear":
        rope_scaling = {"type": "linear",
                        "factor": float(_value(metadata, p + "rope.scaling.factor", source))}
    elif scaling != "none":
        raise ValueError(f"{source}: rope scaling '{scaling}' (metadata "
                         f"'{p}rope.scaling.type') is not supported")
    names = set(tensor_names)
    if "rope_freqs.weight" in names:
        raise ValueError(f"{source}: tensor 'rope_freqs.weight' (Llama 3.1-style rope frequency "
                         "factors) is not supported")
    tokens = _value(metadata, "tokenizer.ggml.tokens", source)
    return ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=_int(metadata, p + "block_count", source),
        intermediate_size=_int(metadata, p + "feed_forward_length", source),
        num_attention_heads=heads,
        num_key_value_heads=_int(metadata, p + "attention.head_count_kv", source, heads),
        head_dim=head_dim,
        rms_norm_eps=float(_value(metadata, p + "attention.layer_norm_rms_epsilon", source)),
        vocab_size=len(tokens),
        max_position_embeddings=_int(metadata, p + "context_length", source, None),
        rope_theta=float(_value(metadata, p + "rope.freq_base", source, 10000.0)),
        rope_traditional=True,  # llama.cpp's q/k row layout (see the module docstring)
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        mlp_bias="blk.0.ffn_up.bias" in names,
    )


def gguf_to_mlx_name(name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if unknown."""
    match = BLOCK_NAME.match(name)
    if match:
        layer, module, suffix = match.groups()
        if module in BLOCK_MODULES and suffix in SUFFIXES:
            return f"model.layers.{layer}.{BLOCK_MODULES[module]}.{suffix}"
        return None
    module, _, suffix = name.rpartition(".")
    if module in TOP_MODULES and suffix in SUFFIXES:
        return f"{TOP_MODULES[module]}.{suffix}"
    return None


def required_tensors(args) -> list[str]:
    """GGUF names of the tensors a llama model with `args` cannot do without."""
    names = ["token_embd.weight", "output_norm.weight"]
    if not args.tie_word_embeddings:
        names.append("output.weight")
    for i in range(args.num_hidden_layers):
        names += [f"blk.{i}.{module}.weight" for module in BLOCK_MODULES]
    return names


def map_weights(tensors: dict[str, mx.array], args, source: str = "<gguf>"
                ) -> tuple[dict[str, mx.array], dict[str, str]]:
    """Rename GGUF tensors to mlx-lm names. -> (weights, mlx name -> GGUF name).

    Every required tensor must be there and every tensor must be known (no silent drops)."""
    missing = [n for n in required_tensors(args) if n not in tensors]
    if missing:
        raise ValueError(f"{source}: missing tensor{'s' if len(missing) > 1 else ''} "
                         + ", ".join(f"'{n}'" for n in missing))
    weights, origin, unknown = {}, {}, []
    for name, value in tensors.items():
        mlx_name = gguf_to_mlx_name(name)
        if mlx_name is None:
            unknown.append(name)
            continue
        weights[mlx_name], origin[mlx_name] = value, name
    if unknown:
        raise ValueError(f"{source}: unsupported tensors for a llama model: "
                         + ", ".join(f"'{n}'" for n in sorted(unknown)))
    return weights, origin


def quantization_plan(weights: dict[str, mx.array], origin: dict[str, str] | None = None,
                      source: str = "<gguf>") -> dict[str, dict]:
    """module path -> `to_quantized` kwargs, for each module whose weight came quantized."""
    plan = {}
    for name, scales in weights.items():
        if not name.endswith(".scales"):
            continue
        module = name.removesuffix(".scales")
        weight = weights.get(module + ".weight")
        gguf = (origin or {}).get(name, name)
        if weight is None or weight.dtype != mx.uint32 or module + ".biases" not in weights:
            raise ValueError(f"{source}: quantized tensor '{gguf}' lacks its packed weight or "
                             "biases")
        in_features = scales.shape[-1] * GROUP_SIZE
        bits, rest = divmod(weight.shape[-1] * 32, in_features)
        if rest or bits not in SUPPORTED_BITS:
            raise ValueError(f"{source}: tensor '{gguf}': cannot infer the bit width "
                             f"(packed {tuple(weight.shape)}, scales {tuple(scales.shape)})")
        plan[module] = {"group_size": GROUP_SIZE, "bits": bits}
    return plan


def build_model(args, weights: dict[str, mx.array], origin: dict[str, str] | None = None,
                source: str = "<gguf>"):
    """An mlx-lm llama `Model` (quantized where the weights are) holding `weights`."""
    from mlx_lm.models.llama import Model

    model = Model(args)
    plan = quantization_plan(weights, origin, source)
    if plan:
        nn.quantize(model, class_predicate=lambda path, _: dict(plan[path])
                    if path in plan else False)
    origin = origin or {}
    problems = mismatches(dict(tree_flatten(model.parameters())), weights,
                          lambda k: f"'{origin.get(k, k)}'" if k in origin else k)
    if problems:
        raise ValueError(f"{source}: tensors do not match the metadata: {problems}")
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    return model


# ----------------------------------------------------------------------------- tokenizer


def pre_tokenizer(pre: str, source: str = "<gguf>"):
    from tokenizers import Regex, pre_tokenizers

    kind = PRE_TOKENIZERS.get(pre)
    if kind is None:
        raise ValueError(f"{source}: unsupported pre-tokenizer '{pre}' (metadata "
                         f"'tokenizer.ggml.pre'); known: {', '.join(sorted(PRE_TOKENIZERS))}")
    if kind == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "digits":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _special_id(metadata: dict, key: str, n_tokens: int, source: str) -> int | None:
    token_id = _int(metadata, key, source, None)
    if token_id is not None and not 0 <= token_id < n_tokens:
        raise ValueError(f"{source}: metadata '{key}' = {token_id} is outside the vocabulary "
                         f"(0..{n_tokens - 1})")
    return token_id


def build_backend_tokenizer(metadata: dict, source: str = "<gguf>"):
    """A `tokenizers.Tokenizer` for the byte-level BPE vocabulary in the metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = _value(metadata, "tokenizer.ggml.model", source)
    if kind != "gpt2":
        raise ValueError(f"{source}: unsupported tokenizer '{kind}' (metadata "
                         "'tokenizer.ggml.model'); only byte-level BPE ('gpt2') is supported")
    tokens = list(_value(metadata, "tokenizer.ggml.tokens", source))
    merges = []
    for merge in _value(metadata, "tokenizer.ggml.merges", source):
        pair = tuple(merge.split(" "))
        if len(pair) != 2:
            raise ValueError(f"{source}: malformed merge {merge!r} in 'tokenizer.ggml.merges'")
        merges.append(pair)
    types = _value(metadata, "tokenizer.ggml.token_type", source, [TOKEN_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise ValueError(f"{source}: 'tokenizer.ggml.token_type' has {len(types)} entries for "
                         f"{len(tokens)} tokens")
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                     byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizer(_value(metadata, "tokenizer.ggml.pre", source,
                                                   "default"), source)
    tokenizer.decoder = decoders.ByteLevel()
    # CONTROL tokens are matched whole and skipped by decode(skip_special_tokens=True);
    # USER_DEFINED ones are matched whole too but decode as text (llama.cpp does both).
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, k in zip(tokens, types) if k == TOKEN_CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, k in zip(tokens, types) if k == TOKEN_USER_DEFINED])
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ValueError(f"{source}: 'tokenizer.ggml.tokens' has duplicate entries")

    bos = _special_id(metadata, "tokenizer.ggml.bos_token_id", len(tokens), source)
    eos = _special_id(metadata, "tokenizer.ggml.eos_token_id", len(tokens), source)
    add_bos = bool(_value(metadata, "tokenizer.ggml.add_bos_token", source, False))
    add_eos = bool(_value(metadata, "tokenizer.ggml.add_eos_token", source, False))
    if (add_bos and bos is None) or (add_eos and eos is None):
        which = "bos" if add_bos and bos is None else "eos"
        raise ValueError(f"{source}: 'tokenizer.ggml.add_{which}_token' is set but metadata "
                         f"'tokenizer.ggml.{which}_token_id' is missing")
    if add_bos or add_eos:
        pre = [tokens[bos]] if add_bos else []
        post = [tokens[eos]] if add_eos else []
        specials = {(tokens[i], i) for i, on in ((bos, add_bos), (eos, add_eos)) if on}
        tokenizer.post_processor = processors.TemplateProcessing(
            single=" ".join(pre + ["$A"] + post),
            pair=" ".join(pre + ["$A"] + post + pre + ["$B:1"] + post),
            special_tokens=sorted(specials, key=lambda s: s[1]))
    return tokenizer


def build_tokenizer(metadata: dict, source: str = "<gguf>"):
    """-> mlx-lm `TokenizerWrapper` around a `PreTrainedTokenizerFast` (chat template, bos/eos/
    pad/unk from the metadata), with mlx-lm's byte-level streaming detokenizer."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    backend = build_backend_tokenizer(metadata, source)
    tokens = _value(metadata, "tokenizer.ggml.tokens", source)
    named = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("pad_token", "padding"),
                      ("unk_token", "unknown")):
        token_id = _special_id(metadata, f"tokenizer.ggml.{key}_token_id", len(tokens), source)
        if token_id is not None:
            named[name] = tokens[token_id]
    types = _value(metadata, "tokenizer.ggml.token_type", source, [])
    control = [t for t, k in zip(tokens, types) if k == TOKEN_CONTROL and t not in named.values()]
    max_len = _int(metadata, f"{ARCHITECTURE}.context_length", source, None)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        additional_special_tokens=control,
        chat_template=_value(metadata, "tokenizer.chat_template", source, None),
        clean_up_tokenization_spaces=False,
        model_max_length=max_len or int(1e30),
        **named)
    # transformers may rebuild the post-processor from its own flags: keep the file's.
    hf.backend_tokenizer.post_processor = backend.post_processor
    eos_ids = [hf.eos_token_id] if hf.eos_token_id is not None else []
    return TokenizerWrapper(hf, BPEStreamingDetokenizer, eos_token_ids=eos_ids)


# ----------------------------------------------------------------------------- entry point


def load_gguf(path: str | Path):
    """-> (mlx-lm llama `Model`, mlx-lm `TokenizerWrapper`) from a llama-architecture GGUF.

    Quantized tensors stay quantized (group size 32, each tensor's own bits). ValueErrors name the
    file and the offending metadata key or tensor."""
    source = str(path)
    tensors, metadata = read_gguf(path)
    args = model_args(metadata, tensors.keys(), source)
    weights, origin = map_weights(tensors, args, source)
    model = build_model(args, weights, origin, source)
    tokenizer = build_tokenizer(metadata, source)
    return model, tokenizer


# ----------------------------------------------------------------------------- header only


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}          # GGUF value type -> struct format (8: string, 9: array)


def read_gguf_header(path: str | Path) -> dict:
    """The scalar metadata of a GGUF file (arrays skipped), read without touching tensors (a
    pipeline plans its split from it before any weight loads)."""
    import struct

    def read(fmt):
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

    def string():
        return f.read(read("<Q")).decode("utf-8", "replace")

    def value(kind):
        if kind == 8:
            return string()
        if kind == 9:
            inner, count = read("<I"), read("<Q")
            if inner in _SCALARS:                     # skip numeric arrays in one seek
                f.seek(count * struct.calcsize(_SCALARS[inner]), 1)
            else:
                for _ in range(count):
                    value(inner)
            return None
        return read(_SCALARS[kind])

    meta = {}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        read("<I")                                     # version
        read("<Q")                                     # tensor count
        for _ in range(read("<Q")):
            key = string()
            meta[key] = value(read("<I"))
    return meta


__all__ = ["load_gguf", "read_gguf", "model_args", "map_weights", "gguf_to_mlx_name",
           "quantization_plan", "build_model", "build_tokenizer", "build_backend_tokenizer",
           "pre_tokenizer", "read_gguf_header"]

