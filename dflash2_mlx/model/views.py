"""Views of an mlx-lm model that run its decoder layers our way, and the rollback of their caches.

One piece used by the single-process target (`target.TargetAdapter`) and by every stage of a
pipeline-sharded one (`distributed.stages`). A *view* is a shallow copy of the modules on the
path from the model down to the one that owns `layers` (every parameter shared) whose `layers`
list holds what we want run: taps that call the real layers and record what passes through
them, a range of the layers, a stand-in that stops the forward or relays the hidden state
elsewhere. Calling a view runs the installed mlx-lm forward pass unchanged, and the model
object and mlx-lm's classes stay untouched.

Rollback after a partial acceptance: attention caches drop the rejected rows; recurrent layers
(GatedDeltaNet in qwen3_5 / qwen3_next), whose state cannot be trimmed, get the state from
before the verify back and re-run the installed layer over the kept rows only (their inputs are
recorded by the taps). Only a `Snapshot` taken before the forward rolls back. A batch (B rows of
recurrent state, `model.row_caches.RecurrentRows`) rolls back per row: `Snapshot.rollback_rows`.
"""

from __future__ import annotations

import copy
from typing import Callable, NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import (ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache,
                                 make_prompt_cache)

# Where decoder stacks live in mlx-lm models: Model.model (llama, qwen2/3, mistral, ...),
# Model.language_model.model (multimodal wrappers such as qwen3_5, gemma3), Model.backbone
# (nemotron_h).
STACK_PATHS = (("model",), ("language_model", "model"), ("language_model",), ("backbone",), ())
# What the stacks call their token embedding (nemotron_h: `embeddings`).
EMBED_NAMES = ("embed_tokens", "embeddings")

# Stack attributes that name the layer whose cache a mask is made from (llama, qwen3_5,
# qwen3_next), and which layers each must point at; recomputed for a view of a layer range.
INDEX_ATTRS = {
    "fa_idx": lambda l: not getattr(l, "use_sliding", False) and not getattr(l, "is_linear",
                                                                               False),
    "swa_idx": lambda l: getattr(l, "use_sliding", False),
    "ssm_idx": lambda l: getattr(l, "is_linear", False),
}


def find_stack_path(model: nn.Module) -> tuple[str, ...]:
    for path in STACK_PATHS:
        module = model
        for name in path:
            module = module.get(name) if isinstance(module, dict) else None
            if module is None:
                break
        if isinstance(module, nn.Module) and isinstance(module.get("layers"), list):
            return path
    family = type(model).__module__.rsplit(".", 1)[-1]
    raise ValueError(f"this target family ('{family}') is not supported: cannot find the decoder "
                     f"layers of its {type(model).__name__}: looked for "
                     f"{', '.join('.'.join(('model',) + p) for p in STACK_PATHS)}.layers")


class RollbackRotatingKVCache(RotatingKVCache):
    """mlx-lm's sliding-window cache, trimmable after a multi-row update.

    A verify block goes through `_update_concat`, which leaves the rows in temporal order with
    the newest last; dropping the rejected rows there is exact. (The parent refuses to trim once
    the window is full because single-row updates rotate the buffer in place.)
    """

    def is_trimmable(self):
        return True

    def trim(self, n):
        n = min(self.offset, n)
        if n and self.keys is not None and self._idx == self.keys.shape[2]:
            self.keys, self.values = self.keys[..., :-n, :], self.values[..., :-n, :]
            self._idx = self.keys.shape[2]
            self.offset -= n
            return n
        if n and self.offset > self.max_size:
            raise RuntimeError("cannot trim a rotated sliding-window cache")
        return super().trim(n)


class KVQuant(NamedTuple):
    """The target's quantized KV cache: mlx-lm's `QuantizedKVCache(group_size, bits)` on every
    full-attention layer, from the first token (docs/decisions.md)."""

    bits: int
    group_size: int

    def __str__(self) -> str:
        return f"{self.bits}-bit, group size {self.group_size}"


def kv_bytes_per_token(n_kv_heads: int, head_dim: int, kv: KVQuant | None = None,
                       itemsize: int = 4) -> int:
    """Bytes one token takes in one full-attention layer's cache, keys and values: float,
    head_dim values of `itemsize` bytes a head; quantized, head_dim * bits / 32 uint32 words
    plus a scale and a bias (of `itemsize` bytes, the activations' dtype) per group."""
    if kv is None:
        return 2 * n_kv_heads * head_dim * itemsize
    return 2 * n_kv_heads * (head_dim * kv.bits // 32 * 4
                             + 2 * (head_dim // kv.group_size) * itemsize)


def model_cache(model: nn.Module, kv: KVQuant | None = None) -> list:
    """mlx-lm's cache for every layer of `model`, with sliding-window caches made trimmable;
    with `kv`, each full-attention layer's `KVCache` is a `QuantizedKVCache` instead (the
    sliding-window and recurrent layers keep theirs)."""
    def convert(c):
        if type(c) is RotatingKVCache:
            return RollbackRotatingKVCache(c.max_size, c.keep)
        if kv is not None and type(c) is KVCache:
            return QuantizedKVCache(kv.group_size, kv.bits)
        return c
    return [convert(c) for c in make_prompt_cache(model)]


class _Probed(Exception):
    """Raised by `_ShapeProbe`: the head dims of the keys and values a layer wrote."""

    def __init__(self, dims: tuple[int, int]):
        self.dims = dims


class _ShapeProbe(QuantizedKVCache):
    """Stops a forward at the first quantized layer with the shapes it was given (known
    without evaluating anything)."""

    def update_and_fetch(self, keys, values):
        raise _Probed((keys.shape[-1], values.shape[-1]))


def check_kv(model: nn.Module, kv: KVQuant) -> None:
    """ValueError when the model cannot run on a quantized KV cache: `kv.group_size` does not
    divide the head_dim of its full-attention layers (mx.quantize would fail at the first
    token), or its forward does not take mlx-lm's quantized cache at all (Gemma 4's layers that
    reuse another layer's keys and values). One lazy token up to the first quantized layer, then
    one through the whole model: shapes and types are checked as the graph is built, before any
    weight is read."""
    cache = [(_ShapeProbe(kv.group_size, kv.bits) if type(c) is QuantizedKVCache else c)
             for c in model_cache(model, kv)]
    if not any(type(c) is _ShapeProbe for c in cache):
        return                           # no full-attention layer: nothing is quantized
    try:
        model(mx.zeros((1, 1), mx.uint32), cache=cache)
    except _Probed as probed:
        bad = sorted({d for d in probed.dims if d % kv.group_size})
        if bad:
            fits = [str(g) for g in (32, 64, 128) if bad[0] % g == 0]
            raise ValueError(
                f"kv_group_size {kv.group_size} does not fit head_dim {bad[0]} of the target's "
                "attention layers (the group size must divide it): "
                + (f"use kv_group_size {' or '.join(fits)}" if fits else
                   "no group size fits; use a float KV cache (no kv_bits)")) from None
    try:
        model(mx.zeros((1, 1), mx.uint32), cache=model_cache(model, kv))
    except (TypeError, ValueError, AttributeError) as e:
        family = type(model).__module__.rsplit(".", 1)[-1]
        raise ValueError(f"kv_bits {kv.bits}: mlx-lm's '{family}' model does not run on a "
                         f"quantized KV cache ({type(e).__name__}: {str(e).splitlines()[0]}); "
                         "use a float KV cache (no kv_bits)") from None


class TargetModel:
    """An mlx-lm model as a target: its decoder stack, embedding and head, its caches (with
    `kv`, quantized: `model_cache`), and views of it. Reads the model; never changes it."""

    def __init__(self, model: nn.Module, kv: KVQuant | None = None):
        self.model = model
        self.kv = kv
        self.path = find_stack_path(model)
        self.stack = model
        for name in self.path:
            self.stack = self.stack[name]
        self.layers = self.stack["layers"]
        self.embed_name = next((n for n in EMBED_NAMES if n in self.stack), EMBED_NAMES[0])
        cache = model_cache(model)
        self.owners = cache_owners(self, cache)
        self.recurrent = tuple(j for j, c in enumerate(cache) if not c.is_trimmable())
        # a stack run `loops` times per forward, each pass with caches of its own (nanbeige)
        n = len(self.layers)
        self.loops = (len(cache) // n if len(cache) > n and self.owners == tuple(range(n)) *
                      (len(cache) // n) else 1)
        self._embed_view = self.view([StandIn(self.layers[0], stop)] + list(self.layers[1:]))
        self._row_heads: dict = {}

    # ---- shape facts
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def tappable(self) -> int:
        """Layer ids a drafter may tap: 0..tappable-1. A looped stack's ids count its unrolled
        steps (loop * num_layers + layer), the last excepted (`LayerRange`)."""
        return self.num_layers if self.loops == 1 else self.loops * self.num_layers - 1

    @property
    def embed_tokens(self) -> nn.Module:
        return self.stack[self.embed_name]

    @property
    def hidden_size(self) -> int:
        e = self.embed_tokens
        return e.dims if isinstance(e, nn.QuantizedEmbedding) else e.weight.shape[1]

    @property
    def vocab_size(self) -> int:
        e = self.embed_tokens
        return e.num_embeddings if isinstance(e, nn.QuantizedEmbedding) else e.weight.shape[0]

    # ---- caches and views
    def make_cache(self) -> list:
        return model_cache(self.model, self.kv)

    def view(self, layers: list, embed=None, reindex: bool = False) -> nn.Module:
        """A shallow copy of the model whose decoder stack runs `layers` (and `embed` in place
        of its embedding). Each module on the path is copied, so the original keeps its own.
        reindex: `layers` is not the whole stack (a layer range, then a stand-in): the mask
        indices (`INDEX_ATTRS`) are recomputed for it; one that finds no layer points at the
        stand-in at the end, whose cache is None (that mask is then never used)."""
        chain = [copy.copy(self.model)]
        for name in self.path:
            child = copy.copy(chain[-1][name])
            chain[-1][name] = child
            chain.append(child)
        stack = chain[-1]
        stack["layers"] = layers
        if embed is not None:
            stack[self.embed_name] = embed
        if reindex:
            for attr, wanted in INDEX_ATTRS.items():
                if attr in vars(stack):
                    setattr(stack, attr, next((i for i, l in enumerate(layers[:-1])
                                               if wanted(l)), len(layers) - 1))
        return chain[0]

    # ---- the ends of the model
    def embed(self, ids: mx.array) -> mx.array:
        """[B, L] ids -> [B, L, H]: exactly what the target's first layer receives, including
        any embedding scale of the family (Gemma multiplies by sqrt(H)), computed by the
        installed forward pass itself up to its first layer."""
        return run_to_stand_in(self._embed_view, ids, None)

    def head_module(self) -> nn.Module:
        """lm_head (Model.lm_head, Model.language_model.lm_head, ...) or the tied embedding."""
        module = self.model
        for name in (None,) + self.path:
            module = module if name is None else module[name]
            if "lm_head" in module:
                return module["lm_head"]
        return self.embed_tokens

    def head(self, h: mx.array) -> mx.array:
        """The target's output projection: lm_head, or the tied embedding."""
        module = self.head_module()
        return module.as_linear(h) if isinstance(module, (nn.Embedding,
                                                          nn.QuantizedEmbedding)) else module(h)

    def head_rows(self, ids: mx.array) -> Callable[[mx.array], mx.array]:
        """The output projection restricted to the vocabulary rows `ids` (a drafter's draft
        vocabulary): a function [..., H] -> [..., len(ids)], built once per `ids` array."""
        cached = self._row_heads.get(id(ids))
        if cached is not None and cached[0] is ids:
            return cached[1]
        module = self.head_module()
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            w, s, b = module.weight[ids], module.scales[ids], module.biases[ids]
            mx.eval(w, s, b)
            gs, bits = module.group_size, module.bits
            fn = lambda h: mx.quantized_matmul(h, w, s, b, transpose=True, group_size=gs,
                                               bits=bits)
        else:
            w = module.weight[ids]
            mx.eval(w)
            fn = lambda h: h @ w.T
        self._row_heads[id(ids)] = (ids, fn)
        return fn


# --------------------------------------------------------------------------- what a view runs


class LayerTap:
    """Calls one target layer and hands its input and output (the hidden state after it) to
    `record(index, x, out)`."""

    def __init__(self, layer: nn.Module, index: int, record: Callable):
        self.layer, self.index, self.record = layer, index, record

    def __call__(self, x, *args, **kwargs):
        out = self.layer(x, *args, **kwargs)
        self.record(self.index, x, out[0] if isinstance(out, tuple) else out)
        return out

    def __getattr__(self, name):
        # needed: mlx-lm's forward reads layer attributes (llama `use_sliding`, qwen3_5
        # `is_linear`) to pick each layer's mask
        return getattr(self.layer, name)


class Stopped(Exception):
    """Raised by `stop`: carries the hidden state a stand-in received."""

    def __init__(self, x):
        self.x = x


def stop(x):
    raise Stopped(x)


class StandIn:
    """Takes the place of a layer in a view: `run(x)` instead of the layer (`stop`: end the
    forward there and hand x out; or relay x elsewhere and return what comes back)."""

    def __init__(self, layer: nn.Module, run: Callable):
        self.layer, self.run = layer, run

    def __call__(self, x, *args, **kwargs):
        return self.run(x)

    def __getattr__(self, name):   # as LayerTap's: the forward reads layer attributes
        return getattr(self.layer, name)


class Incoming:
    """Stands in for the embedding: the forward starts from the hidden state put in `x`."""

    def __init__(self):
        self.x = None

    def __call__(self, ids):
        return self.x


def run_to_stand_in(view: nn.Module, ids: mx.array, cache) -> mx.array:
    """Run a view whose stand-in `stop`s the forward -> the hidden state the stand-in got."""
    try:
        view(ids, cache=cache)
    except Stopped as stopped:
        return stopped.x
    raise RuntimeError("the target's forward pass never reached the stand-in of its view")


# --------------------------------------------------------------------------- layer ranges


class LayerRange:
    """Layers [lo, hi) of a target, run through taps that record the outputs of the feature
    layers among them (`outputs`, by layer index) and the inputs of the layers that own
    recurrent caches (what a rollback replays). Their cache is the list of the caches those
    layers own (`TargetModel.owners`), in the model's order: `caches` names them by index in
    the whole model's list (one per layer, cache[i - lo], for most families).

    A looped stack (`TargetModel.loops` > 1, nanbeige; whole range only) is tapped as its
    reference implementation taps it: feature u, an unrolled step, is the hidden state entering
    step u + 1 (after a mid-loop layer, its output; at the end of a loop, the state after the
    loop's final norm, as the next loop receives it)."""

    def __init__(self, target: TargetModel, lo: int, hi: int, features=()):
        self.target, self.lo, self.hi = target, lo, hi
        end = target.tappable if target.loops > 1 else hi
        self.features = tuple(sorted(i for i in set(features) if lo <= i < end))
        # looped: unrolled step u + 1 -> feature u, and how often each layer ran this forward
        self.steps = {u + 1: u for u in self.features} if target.loops > 1 else {}
        self.calls: dict[int, int] = {}
        self.caches = tuple(j for j, i in enumerate(target.owners) if lo <= i < hi)
        self.recurrent = tuple(j for j in target.recurrent if j in self.caches)
        self.replayed = {target.owners[j] for j in self.recurrent}     # layer indices
        self.outputs: dict[int, mx.array] = {}
        self.inputs: dict[int, mx.array] = {}     # replaced by each snapshot (its own)

    def _record(self, i: int, x: mx.array, out: mx.array) -> None:
        if self.steps:
            k = self.calls.get(i, 0)                  # reset by each forward
            self.calls[i] = k + 1
            u = self.steps.get(k * self.target.num_layers + i)
            if u is not None:
                self.outputs[u] = x
        elif i in self.features:
            self.outputs[i] = out
        if i in self.replayed:
            self.inputs[i] = x

    def view(self, end: StandIn | None = None, embed=None) -> nn.Module:
        """A view running this range (taps where something is recorded), then `end`."""
        n = self.target.num_layers
        tapped = ({s % n for s in self.steps} if self.steps else set(self.features)) \
            | self.replayed
        layers = [LayerTap(self.target.layers[i], i, self._record) if i in tapped
                  else self.target.layers[i] for i in range(self.lo, self.hi)]
        whole = (self.lo, self.hi) == (0, self.target.num_layers)
        return self.target.view(layers + ([end] if end is not None else []), embed,
                                reindex=not whole)

    def make_cache(self) -> list:
        cache = model_cache(self.target.model, self.target.kv)
        return [cache[j] for j in self.caches]

    def replay(self, j: int, x: mx.array, cache) -> None:
        """Feed the rows `x` (inputs of the layer owning whole-model cache j) through that
        layer into `cache`. Its output is never evaluated: only the recurrent part runs."""
        self.target.layers[self.target.owners[j]](x, mask=None, cache=cache)

    def unrollable(self, cache: list) -> list[str]:
        """Type names of the caches in `cache` that can neither be trimmed nor replayed."""
        return sorted({type(c).__name__ for j, c in zip(self.caches, cache)
                       if not c.is_trimmable() and not (j in self.recurrent
                                                        and isinstance(c, ArraysCache))})

    def snapshot(self, cache: list) -> "Snapshot":
        return Snapshot(self, cache)

    def trim(self, cache: list, n: int) -> None:
        """Drop the last n rows without a snapshot: attention caches only."""
        if n and self.recurrent:
            raise RuntimeError(f"layer {self.target.owners[self.recurrent[0]]} (recurrent) "
                               f"cannot go back {n} rows without a snapshot")
        for c in cache:
            c.trim(n)


class Snapshot:
    """A layer range's cache as it was before a forward: attention caches need only the row
    count; recurrent layers keep their state (array references: cheap) and, from the taps, the
    inputs the forward after this snapshot fed them. Keyed by whole-model cache index."""

    def __init__(self, layers: LayerRange, cache: list):
        self.layers, self.cache = layers, cache
        self.at = dict(zip(layers.caches, cache))          # whole-model index -> cache
        self.state = {j: [list(s) if isinstance(s, list) else s for s in self.at[j].state]
                      for j in layers.recurrent}
        self.inputs = layers.inputs = {}

    def _inputs(self, j: int) -> mx.array:
        return self.inputs[self.layers.target.owners[j]]

    def rollback(self, kept: int, total: int) -> None:
        """Make every layer's cache what it would be had the forward fed only `kept` of its
        `total` rows."""
        if kept == total:
            return
        for j, c in self.at.items():
            if j in self.state:
                # the state from before, then the installed layer over the kept rows
                c.state = self.state[j]
                if kept:
                    self.layers.replay(j, self._inputs(j)[:, :kept], c)
            else:
                c.trim(total - kept)

    def rollback_rows(self, keep, total: int) -> None:
        """A batch's recurrent layers after a forward of `total` rows per row: row b keeps the
        first keep[b] (attention caches roll back by their own `commit`). The rows that keep
        fewer than `total` get their state from before the forward back, and the installed
        layer re-runs over their kept inputs, one call per distinct count; the new state is
        written into their rows."""
        keep = np.asarray(keep, np.int64)
        short = np.flatnonzero(keep < total)
        if not len(short):
            return
        groups = [(k, short[keep[short] == k]) for k in sorted(set(keep[short].tolist()))]
        for j, (before, *_) in self.state.items():
            c = self.at[j]
            for k, rows in groups:
                idx = mx.array(rows.astype(np.int32))
                sub = ArraysCache(len(before))
                sub.cache = [s[idx] for s in before]
                if k:      # as in `rollback`: only the recurrent part is ever evaluated
                    self.layers.replay(j, self._inputs(j)[idx, :k], sub)
                # a scatter into the forward's new arrays (each entry was replaced by the
                # forward, so no other cache or snapshot holds them)
                for s, new in zip(c.cache, sub.cache):
                    s[idx] = new


# --------------------------------------------------------------------------- cache owners


class _CacheProbe:
    """Stands in for layer `index` in `cache_owners`: notes the cache it is handed, then runs
    the layer."""

    def __init__(self, layer: nn.Module, index: int, seen: dict):
        self.layer, self.index, self.seen = layer, index, seen

    def __call__(self, x, *args, **kwargs):
        c = kwargs.get("cache", args[1] if len(args) > 1 else None)
        self.seen.setdefault(id(c), self.index)
        return self.layer(x, *args, **kwargs)

    def __getattr__(self, name):   # as LayerTap's
        return getattr(self.layer, name)


def cache_owners(target: TargetModel, cache: list) -> tuple[int, ...]:
    """Whole-model cache index -> the decoder layer it is handed to. One cache per layer (most
    families): the identity. Otherwise (nemotron_h: caches for its Mamba and attention blocks
    only; gemma4: none for the layers that reuse another's keys and values; nanbeige: one per
    layer per loop) found from one lazy token through a view whose layers note the cache they
    are given; nothing is evaluated."""
    if len(cache) == target.num_layers:
        return tuple(range(len(cache)))
    seen: dict = {}
    view = target.view([_CacheProbe(l, i, seen) for i, l in enumerate(target.layers)])
    view(mx.zeros((1, 1), mx.uint32), cache=cache)
    owners = tuple(seen.get(id(c), -1) for c in cache)
    if -1 in owners:
        family = type(target.model).__module__.rsplit(".", 1)[-1]
        raise ValueError(f"this target family ('{family}') is not supported: cache "
                         f"{owners.index(-1)} of its make_cache() reaches no decoder layer")
    return owners
