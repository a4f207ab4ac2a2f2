"""Weight helpers shared by the loaders (`checkpoint.py` for drafters and mlx-lm targets,
`gguf.py` for GGUF targets): reading safetensors, casting, what counts as quantized, and the
one-line report of tensors that do not match a model."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from ..model.config import CheckpointError


def read_safetensors(folder: Path) -> dict[str, mx.array]:
    """Every `*.safetensors` file of `folder`, merged: name -> array."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors weight files")
    weights: dict[str, mx.array] = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except (RuntimeError, ValueError, OSError) as e:
            raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from e
    return weights


def mismatches(expected: dict, weights: dict, name=lambda k: k) -> str:
    """Every missing, unexpected and mis-shaped tensor by name, in one line ('' when none).
    expected/weights: name -> array; `name` maps a key to the name the user's file uses."""
    missing = sorted(name(k) for k in expected.keys() - weights.keys())
    unexpected = sorted(name(k) for k in weights.keys() - expected.keys())
    misshaped = sorted(f"{name(k)} {tuple(weights[k].shape)} (expected {tuple(expected[k].shape)})"
                       for k in expected.keys() & weights.keys()
                       if weights[k].shape != expected[k].shape)
    return "; ".join(f"{what} tensors: {', '.join(keys)}" for what, keys in
                     (("missing", missing), ("unexpected", unexpected),
                      ("mis-shaped", misshaped)) if keys)


def cast_floats(model: nn.Module, dtype) -> None:
    """Cast every floating-point parameter (not quantized integers) to `dtype`, in place."""
    model.update(tree_map(
        lambda x: x.astype(dtype) if mx.issubdtype(x.dtype, mx.floating) else x,
        model.parameters()))


def quantized_layers(model: nn.Module) -> list[nn.Module]:
    """The quantized layers of a model (the one place that decides what "quantized" means)."""
    return [m for _, m in model.named_modules()
            if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]


def is_quantized(model: nn.Module) -> bool:
    return bool(quantized_layers(model))


def quantization(model: nn.Module) -> dict | None:
    """{"bits", "group_size", "layers"} of a model's quantized layers, None when it has none."""
    layers = quantized_layers(model)
    if not layers:
        return None
    return {"bits": layers[0].bits, "group_size": layers[0].group_size, "layers": len(layers)}
