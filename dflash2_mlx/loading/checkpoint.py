"""Loading targets and drafters: resolve paths or hub ids, read configs and weights strictly.

Targets are mlx-lm model folders (any family mlx-lm knows) or llama-architecture `.gguf` files.
Drafters are DFlash / DFlash 2 checkpoint folders in the published format (z-lab's
`config.json` + `model.safetensors` layout), or DSpark folders in DeepSpec's.
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..model.config import CheckpointError, DrafterArgs
from ..model.drafter import Drafter, DraftVocab
from .weights import cast_floats, is_quantized, mismatches, quantized_layers, read_safetensors

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Tensors some early DFlash checkpoints carried; the drafter uses the target's instead (a
# DSpark drafter that ships them uses its own).
IGNORED_PREFIXES = ("embed_tokens.", "lm_head.", "model.embed_tokens.")
# Published files store the selector codebooks as bare tensors, without ".weight".
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def resolve(path_or_id: str | Path, what: str, allow_patterns: list[str] | None = None) -> Path:
    """A local file/folder as is; otherwise a Hugging Face Hub id, downloaded (or cached): a
    failed download is a one-line `hub.HubError` naming the id and the fix."""
    path = Path(path_or_id).expanduser()
    if path.exists():
        return path
    text = str(path_or_id)
    if not is_hub_id(text):
        raise FileNotFoundError(f"{what} '{text}': no such file or folder")
    from .hub import snapshot

    return snapshot(text, what, allow_patterns)


def is_hub_id(text: str) -> bool:
    """"organization/name", not a path that merely looks like one."""
    return bool(HUB_ID.match(text)) and not text.startswith((".", "/", "~"))


def load_target(path_or_id: str | Path, dtype=None, keep_quantized: bool = False,
                lazy: bool = False):
    """-> (mlx-lm model, mlx-lm TokenizerWrapper, resolved path).

    `dtype` casts the float weights; unless `keep_quantized`, quantized layers are dequantized
    first (the CPU backend runs fp32 matmuls through BLAS, quantized ones much slower).
    `lazy`: leave the weights unread (a pipeline rank then loads only its own).
    """
    text = str(path_or_id)
    if text.endswith(".gguf"):
        from .gguf import load_gguf

        path = resolve(text, "target model")
        model, tokenizer = load_gguf(path)
    else:
        from mlx_lm.utils import load as mlx_lm_load

        path = resolve(text, "target model",
                       ["*.json", "*.safetensors", "*.py", "tokenizer.model", "*.tiktoken",
                        "*.txt", "*.jsonl", "*.jinja"])
        if path.is_file():
            raise ValueError(f"target model '{path}': expected an mlx-lm model folder or a "
                             ".gguf file")
        model, tokenizer = mlx_lm_load(str(path), lazy=lazy)
    if dtype is not None:
        if not keep_quantized and is_quantized(model):
            from mlx_lm.utils import dequantize_model

            model = dequantize_model(model)
        cast_floats(model, dtype)
    model.eval()
    if not lazy:
        mx.eval(model.parameters())
    return model, tokenizer, path


def load_drafter_weights(drafter: Drafter, weights: dict[str, mx.array], source: str) -> None:
    """Load by the published tensor names; every missing, unexpected or mis-shaped tensor is
    reported by name in one error."""
    if not drafter.args.is_dspark:
        weights = {k: v for k, v in weights.items() if not k.startswith(IGNORED_PREFIXES)}
    for name in CODEBOOKS:
        if name in weights:
            weights[name + ".weight"] = weights.pop(name)
    problems = mismatches(dict(tree_flatten(drafter.parameters())), weights,
                          lambda k: k.removesuffix(".weight") if k.startswith(CODEBOOKS) else k)
    if problems:
        raise CheckpointError(f"{source}: weights do not match the config: {problems}")
    drafter.load_weights(list(weights.items()), strict=True)


DRAFT_VOCAB = "draft_vocab.json"


def read_draft_vocab(folder: Path, args: DrafterArgs) -> DraftVocab | None:
    """The optional draft vocabulary beside the weights (see `drafter.DraftVocab`)."""
    path = folder / DRAFT_VOCAB
    if not path.exists():
        return None
    try:
        ids = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: malformed JSON ({e})") from e
    if (not isinstance(ids, list) or not all(isinstance(i, int) for i in ids)
            or ids != sorted(set(ids)) or not ids or not 0 <= ids[0] <= ids[-1] < args.vocab_size):
        raise CheckpointError(f"{path}: expected a sorted list of distinct token ids in "
                              f"0..{args.vocab_size - 1}")
    if len(ids) < max(args.selector_top_k, 1):
        raise CheckpointError(f"{path}: {len(ids)} ids, fewer than the selector's top-k "
                              f"({args.selector_top_k})")
    return DraftVocab(ids)


def norms(drafter: Drafter) -> dict[str, nn.RMSNorm]:
    """The drafter's RMS norms by path (a qwen3_5-flavoured checkpoint stores their weights as
    offsets from one)."""
    return {path: m for path, m in drafter.named_modules() if isinstance(m, nn.RMSNorm)}


def draft_to_target(weights: dict, args: DrafterArgs, source: str) -> DraftVocab | None:
    """A reduced-vocabulary DSpark head's id map, taken out of `weights`: the `d2t` tensor holds
    offsets (target id = draft id + d2t[draft id]); `t2d`, the inverse mask, is not needed."""
    d2t = weights.pop("d2t", None)
    weights.pop("t2d", None)
    size = args.draft_vocab_size
    if (d2t is None) != (size is None):
        raise CheckpointError(f"{source}: " + (
            f"'draft_vocab_size' is {size} but the weights hold no 'd2t' table" if d2t is None
            else "the weights hold a 'd2t' table but the config has no 'draft_vocab_size'"))
    if d2t is None:
        return None
    ids = mx.arange(d2t.size) + d2t.reshape(-1).astype(mx.int32)
    if d2t.size != size or mx.any((ids < 0) | (ids >= args.vocab_size)).item() or \
            len(set(ids.tolist())) != size:
        raise CheckpointError(f"{source}: 'd2t' must map {size} draft ids to distinct target ids "
                              f"in 0..{args.vocab_size - 1}")
    return DraftVocab(ids.tolist())


def quantize_drafter(drafter: Drafter, bits: int, group_size: int = 64) -> None:
    """Quantize the linear layers and the selector codebooks; norms and the convolution base
    kernels (plain arrays, not layers) stay in full precision."""
    if bits not in (4, 8):
        raise ValueError(f"draft_bits must be 4, 8 or None (unquantized), got {bits}")
    if group_size not in (32, 64, 128):
        raise ValueError(f"draft group size must be 32, 64 or 128, got {group_size}")

    def pick(path: str, module: nn.Module) -> bool:
        if not isinstance(module, (nn.Linear, nn.Embedding)) or path.startswith("confidence_head"):
            return False                   # one output: quantizing it saves nothing
        return module.weight.shape[-1] % group_size == 0

    nn.quantize(drafter, group_size=group_size, bits=bits, class_predicate=pick)


def save_drafter(drafter: Drafter, folder: str | Path, dtype=mx.bfloat16) -> Path:
    """Write `config.json` + `model.safetensors` in the published layout (z-lab's).

    An unquantized drafter is stored in `dtype` (BF16 like the published files). A quantized one
    is stored as is, with mlx-lm's `"quantization": {"group_size", "bits"}` config key, which
    `load_drafter` reads back.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    offsets = {f"{path}.weight" for path in norms(drafter)} if drafter.args.norm_offset else set()
    for name, value in tree_flatten(drafter.parameters()):
        base = name.removesuffix(".weight")
        if base in CODEBOOKS:
            name = base
        if name in offsets:
            value = value - 1.0
        if mx.issubdtype(value.dtype, mx.floating) and not is_quantized(drafter):
            value = value.astype(dtype)
        tensors[name] = value
    config = drafter.args.to_config()
    d2t = drafter.args.draft_vocab_size and drafter.draft_vocab is not None
    if d2t:                  # a DSpark head's draft vocabulary, as its `d2t` offsets
        ids = drafter.draft_vocab.ids.astype(mx.int32)
        tensors["d2t"] = ids - mx.arange(ids.size, dtype=mx.int32)
    quantized = quantized_layers(drafter)
    if quantized:
        config["quantization"] = {"group_size": quantized[0].group_size,
                                  "bits": quantized[0].bits}
    with tempfile.TemporaryDirectory(dir=folder) as tmp:   # nothing half-written on failure
        mx.save_safetensors(str(Path(tmp) / "model.safetensors"), tensors)
        (Path(tmp) / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        names = ["model.safetensors", "config.json"]
        if drafter.draft_vocab is not None and not d2t:
            (Path(tmp) / DRAFT_VOCAB).write_text(json.dumps(drafter.draft_vocab.ids.tolist()))
            names.append(DRAFT_VOCAB)
        for name in names:
            (Path(tmp) / name).replace(folder / name)
    return folder


def stored_quantization(folder: str | Path) -> dict | None:
    """The "quantization" entry ({"bits", "group_size"}) of a drafter folder's config.json;
    None when the checkpoint is unquantized, or when the config cannot be read (loading it
    reports that clearly)."""
    try:
        return json.loads((Path(folder) / "config.json").read_text()).get("quantization")
    except (OSError, ValueError, AttributeError):
        return None


def load_drafter(path_or_id: str | Path, *, hidden_size: int, vocab_size: int, num_layers: int,
                 dtype=None, bits: int | None = None, group_size: int = 64,
                 keep_quantized: bool = False, target: str = "the target") -> Drafter:
    """Read config + weights from a drafter folder, check them against the target's shape
    (`target` names it in the error of a mismatch).

    A checkpoint stored quantized is dequantized when `dtype` is given, unless `bits` asks for
    quantization or `keep_quantized` is set; `bits` quantizes an unquantized one.
    """
    folder = resolve(path_or_id, "draft model", ["*.json", "*.safetensors"])
    if folder.is_file():
        raise CheckpointError(f"{folder}: a drafter is a folder with config.json and "
                              "*.safetensors")
    args = DrafterArgs.from_file(folder)
    args.check_against_target(hidden_size, vocab_size, num_layers, str(folder / "config.json"),
                              target)
    weights = read_safetensors(folder)
    d2t = draft_to_target(weights, args, str(folder))
    if args.is_dspark:       # the tensors say which parts it has: its own embedding and head
        markov = "markov_head.markov_w1.weight" in weights   # (else the target's), the heads
        proj = weights.get("confidence_head.proj.weight")    # [1, H (+ Markov rank)]
        args = replace(args, own_embed="embed_tokens.weight" in weights,
                       own_head="lm_head.weight" in weights,
                       markov_rank=args.markov_rank if markov else 0,
                       confidence_head=proj is not None,
                       confidence_with_markov=markov and proj is not None
                       and proj.shape[-1] > args.hidden_size)
    elif "confidence_head.proj.weight" in weights:   # one trained on a DFlash drafter
        args = replace(args, confidence_head=True)     # (`train --heads confidence`)
    drafter = Drafter(args)
    stored = stored_quantization(folder)
    if stored:   # a checkpoint saved quantized: give the model the same structure first
        quantize_drafter(drafter, int(stored["bits"]), int(stored["group_size"]))
    load_drafter_weights(drafter, weights, str(folder))
    if args.norm_offset:                 # stored as offsets from one: the norms' own weights
        for norm in norms(drafter).values():
            norm.weight = norm.weight + 1.0
    drafter.draft_vocab = d2t or read_draft_vocab(folder, args)
    if dtype is not None:
        if stored and bits is None and not keep_quantized:
            from mlx_lm.utils import dequantize_model

            drafter = dequantize_model(drafter)
        cast_floats(drafter, dtype)
    if bits is not None and not is_quantized(drafter):
        quantize_drafter(drafter, bits, group_size)
    drafter.eval()
    mx.eval(drafter.parameters())
    return drafter
