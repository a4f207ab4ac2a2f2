"""What a target forward takes beside token ids (`Inputs`): the rows' embeddings where an image
is (a vision tower's features in place of its placeholder tokens), positions where a family's
rope does not count rows (Qwen's multimodal rope), and what some families add inside the
stack (`ImageLayer`: Gemma 4's image rows attend to each other both ways; Qwen3-VL adds
DeepStack features to the first layers' outputs).

Multimodal rope: an image's tokens sit at (t, h, w) grid positions, and the text after it
continues from the grid's largest position + 1, so every later row's position is its row index
plus the prompt's `shift` (negative). mlx-lm's text model ropes by the cache's row count; a
view of it (`positioned`) runs its attention layers with their `rope` replaced by `ShiftedRope`,
which adds each row's shift, or takes explicit [3, B, T] positions for a prefill chunk that
holds an image. With neither set it is the layer's own rope, call for call.
"""

from __future__ import annotations

import copy
from typing import NamedTuple, Sequence

import mlx.core as mx
import mlx.nn as nn


class Inputs(NamedTuple):
    """embeds [B, T, H]: what the model takes as `input_embeddings` (before any embedding
    scale of its own), or None (the tokens' embeddings); positions [3, B, T] (t, h, w) or None;
    shift: each row's rope shift ([B] int32 array or an int), or None. For a prefill chunk:
    start, its first row's index in the sequence; blocks [1, T]: each row's image (0, 1, ..;
    -1: not an image row), rows of one image attending to each other both ways; deepstack:
    [1, T, H] per early layer, added to that layer's output."""

    embeds: mx.array | None = None
    positions: mx.array | None = None
    shift: mx.array | int | None = None
    start: int = 0
    blocks: mx.array | None = None
    deepstack: tuple | None = None


class MRope(NamedTuple):
    """A family's multimodal rope layout: `section` frequencies per axis (t, h, w), laid out
    `chunked` (qwen2_vl, qwen2_5_vl: [t t .. h h .. w w ..]) or `interleaved` (qwen3_vl,
    qwen3_5: t h w t h w ..)."""

    section: tuple[int, int, int]
    style: str

    def selector(self, freqs: int) -> mx.array:
        """Which axis (0 t, 1 h, 2 w) each of the `freqs` rotary frequencies reads."""
        axis = [0] * freqs
        if self.style == "interleaved":
            for a in (1, 2):
                for i in range(a, min(self.section[a] * 3, freqs), 3):
                    axis[i] = a
        else:
            start = self.section[0]
            for a in (1, 2):
                for i in range(start, min(start + self.section[a], freqs)):
                    axis[i] = a
                start += self.section[a]
        return mx.array(axis, dtype=mx.int32)


class CurrentInputs:
    """The `Inputs` of the forward being built, for the view's ropes and layers (set by
    `TargetAdapter.forward` around the call; read while the graph is built, so nothing
    outlives the call)."""

    def __init__(self):
        self.inputs: Inputs | None = None


class ShiftedRope(nn.Module):
    """A layer's rope (mlx's `nn.RoPE`) that also takes the rows' shift or explicit
    multimodal positions from `rows`."""

    def __init__(self, rope: nn.RoPE, mrope: MRope, rows: CurrentInputs):
        super().__init__()
        self._rope, self._rows = rope, rows
        self._dims = rope.dims
        self._inv_freq = rope.base ** (-mx.arange(0, rope.dims, 2, dtype=mx.float32) / rope.dims)
        self._axis = mrope.selector(rope.dims // 2)

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        inputs = self._rows.inputs
        if inputs is not None and inputs.positions is not None:
            return self._explicit(x, inputs.positions)
        if inputs is not None and inputs.shift is not None:
            offset = offset + inputs.shift
        return self._rope(x, offset=offset)

    def _explicit(self, x: mx.array, positions: mx.array) -> mx.array:
        """x [B, heads, T, D] rotated at positions [3, B, T]: frequency i by axis axis[i],
        halves paired as `nn.RoPE(traditional=False)` pairs them."""
        pos = mx.take(positions, self._axis, axis=0).transpose(1, 2, 0)   # [B, T, dims/2]
        angles = (pos.astype(mx.float32) * self._rope.scale * self._inv_freq)[:, None]
        cos, sin = mx.cos(angles).astype(x.dtype), mx.sin(angles).astype(x.dtype)
        half = self._dims // 2
        a, b, rest = x[..., :half], x[..., half:self._dims], x[..., self._dims:]
        return mx.concatenate([a * cos - b * sin, a * sin + b * cos, rest], axis=-1)


class ImageLayer:
    """Runs decoder layer `index` with what an image chunk adds (`rows.inputs`): its mask
    with each image's rows attending to each other both ways (`blocks`), and the DeepStack
    features added to its output. Otherwise the layer's own call. window: the layer's sliding
    window (None: full attention)."""

    def __init__(self, layer: nn.Module, index: int, rows: CurrentInputs, window: int | None):
        self.layer, self.index, self.rows, self.window = layer, index, rows, window

    def __call__(self, x, *args, **kwargs):
        inputs = self.rows.inputs
        if inputs is not None and inputs.blocks is not None and x.shape[1] > 1:
            if args:
                args = (self._overlay(args[0], inputs, x.shape[1]),) + args[1:]
            else:
                kwargs["mask"] = self._overlay(kwargs.get("mask"), inputs, x.shape[1])
        out = self.layer(x, *args, **kwargs)
        deep = inputs.deepstack if inputs is not None else None
        if deep is not None and self.index < len(deep):
            out = (out[0] + deep[self.index], *out[1:]) if isinstance(out, tuple) else \
                out + deep[self.index]
        return out

    def _overlay(self, mask, inputs: Inputs, T: int):
        """The mask with same-image rows of this chunk unmasked: a mask array's last T key
        columns are this chunk's rows; "causal" is made explicit over start + T keys."""
        if mask is None or isinstance(mask, str):
            keys = mx.arange(inputs.start + T)[None]
            rows = inputs.start + mx.arange(T)[:, None]
            mask = keys <= rows
            if self.window is not None:
                mask = mask & (rows - keys < self.window)
        if mask.dtype != mx.bool_:
            return mask                  # an additive mask: not one mlx-lm makes for a prefill
        b = inputs.blocks[0]
        same = (b[:, None] == b[None, :]) & (b[:, None] >= 0)
        return mx.concatenate([mask[..., :-T], mask[..., -T:] | same], axis=-1)

    def __getattr__(self, name):   # as views.LayerTap's: the forward reads layer attributes
        return getattr(self.layer, name)


def rope_refusal(layers: Sequence[nn.Module]) -> str | None:
    """Why the layers' ropes cannot take multimodal positions, or None."""
    found = False
    for i, layer in enumerate(layers):
        for name, child in layer.children().items():
            if isinstance(child, nn.Module) and "rope" in child:
                rope = child["rope"]
                if type(rope) is not nn.RoPE or rope.traditional:
                    return (f"layer {i}'s {name}.rope is a {type(rope).__name__}"
                            f"{' (traditional)' if type(rope) is nn.RoPE else ''}; multimodal "
                            "positions need mlx's plain nn.RoPE")
                found = True
    return None if found else "no attention layer with a `rope` was found"


class ImageRows(NamedTuple):
    """What a vision-language family needs inside its stack (`image_layers`): mrope, its
    multimodal rope (None: rows count positions); deepstack, how many early layers get
    DeepStack features; bidirectional, image rows attend both ways (`window`: the sliding
    window of the layers whose `layer_type` is "sliding_attention")."""

    mrope: MRope | None = None
    deepstack: int = 0
    bidirectional: bool = False
    window: int | None = None

    def __bool__(self) -> bool:
        return self.mrope is not None or self.deepstack > 0 or self.bidirectional


def image_layers(layers: Sequence[nn.Module], how: ImageRows, rows: CurrentInputs) -> list:
    """Layers that take `rows`' inputs as `how` says: copies (every parameter shared) whose
    attention ropes are `ShiftedRope`s, wrapped in `ImageLayer` where a layer's mask or output
    changes; the layers themselves are untouched."""
    out = []
    for i, layer in enumerate(layers):
        copied = None
        for name, child in layer.children().items():
            if how.mrope is not None and isinstance(child, nn.Module) and "rope" in child:
                copied = copied or copy.copy(layer)
                attn = copy.copy(child)
                attn["rope"] = ShiftedRope(child["rope"], how.mrope, rows)
                copied[name] = attn
        layer = copied or layer
        if how.bidirectional or i < how.deepstack:
            sliding = getattr(layer, "layer_type", "") == "sliding_attention"
            layer = ImageLayer(layer, i, rows, how.window if sliding else None)
        out.append(layer)
    return out
