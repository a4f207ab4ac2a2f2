"""Target adapter: run an mlx-lm model and capture the hidden states of chosen layers.

We never patch mlx-lm classes nor the user's model. Instead the adapter builds a *view*: shallow
copies of the modules on the path from the model down to the one that owns `layers` (sharing
every parameter), whose `layers` list holds taps that call the real layers and record their
outputs. Calling the view runs the installed mlx-lm forward pass unchanged, so its logits are the
model's own (checked at load time and in the tests), while the original object stays untouched.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, RotatingKVCache, make_prompt_cache

# Where decoder stacks live in mlx-lm models: Model.model (llama, qwen2/3, mistral, ...),
# Model.language_model.model (multimodal wrappers such as qwen3_5, gemma3).
STACK_PATHS = (("model",), ("language_model", "model"), ("language_model",), ())


class LayerTap:
    """Calls one target layer and stores its output (the hidden state after that layer) in
    `outputs[slot]`, and, when `inputs` is given, its input in `inputs[index]` (recurrent layers:
    the rows to replay on rollback)."""

    def __init__(self, layer: nn.Module, index: int, slot: int | None, outputs: list,
                 inputs: dict | None = None):
        self.layer, self.index, self.slot = layer, index, slot
        self.outputs, self.inputs = outputs, inputs

    def __call__(self, x, *args, **kwargs):
        if self.inputs is not None:
            self.inputs[self.index] = x
        out = self.layer(x, *args, **kwargs)
        if self.slot is not None:
            self.outputs[self.slot] = out[0] if isinstance(out, tuple) else out
        return out

    def __getattr__(self, name):  # the forward may read layer attributes (e.g. use_sliding)
        return getattr(self.layer, name)


def find_stack_path(model: nn.Module) -> tuple[str, ...]:
    for path in STACK_PATHS:
        module = model
        for name in path:
            module = module.get(name) if isinstance(module, dict) else None
            if module is None:
                break
        if isinstance(module, nn.Module) and isinstance(module.get("layers"), list):
            return path
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}: looked for "
                     f"{', '.join('.'.join(('model',) + p) for p in STACK_PATHS)}.layers")


class _FirstLayerInput(Exception):
    def __init__(self, x):
        self.x = x


class _StopAtFirstLayer:
    """Stands in for layer 0 of a view: hands back the embeddings and stops the forward."""

    def __init__(self, layer):
        self.layer = layer

    def __call__(self, x, *args, **kwargs):
        raise _FirstLayerInput(x)

    def __getattr__(self, name):
        return getattr(self.layer, name)


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


class TargetAdapter:
    """Logits plus concatenated hidden states of `layer_ids` from one forward of the target.

    `forward(tokens [B, T], cache)` -> (logits [B, T, V], features [B, T, len(layer_ids) * H]).

    Rollback after a partial acceptance (`snapshot()` before the verify, its `rollback` after):
    attention caches drop the rejected rows; recurrent layers (GatedDeltaNet in qwen3_5 /
    qwen3_next), whose state cannot be trimmed, get the state from before the verify back and
    re-run the installed layer over the kept rows only (their inputs are recorded by the taps).
    """

    def __init__(self, model: nn.Module, layer_ids: tuple[int, ...] = ()):
        self.model = model
        self.path = find_stack_path(model)
        self.stack = self._descend(model, self.path)
        self.layers = self.stack["layers"]
        self.layer_ids = tuple(layer_ids)
        probe = self.make_cache()
        self.recurrent = tuple(i for i, c in enumerate(probe) if not c.is_trimmable())
        self._store: list = [None] * len(self.layer_ids)
        self.recorded_inputs: dict = {}
        self._row_heads: dict = {}
        self._view = self._build_view(self._taps())
        self._embed_view = self._build_view([_StopAtFirstLayer(self.layers[0])]
                                            + list(self.layers[1:]))

    @staticmethod
    def _descend(model, path):
        for name in path:
            model = model[name]
        return model

    def _taps(self) -> list:
        layers = list(self.layers)
        for i in sorted(set(self.layer_ids) | set(self.recurrent)):
            slot = self.layer_ids.index(i) if i in self.layer_ids else None
            layers[i] = LayerTap(self.layers[i], i, slot, self._store,
                                 self.recorded_inputs if i in self.recurrent else None)
        return layers

    def _build_view(self, layers: list) -> nn.Module:
        """A shallow copy of the model whose decoder stack runs `layers`. Each module on the
        path is copied, so swapping `layers` leaves the original alone; parameters are shared."""
        chain = [copy.copy(self.model)]
        for name in self.path:
            child = copy.copy(chain[-1][name])
            chain[-1][name] = child
            chain.append(child)
        chain[-1]["layers"] = layers
        return chain[0]

    # ---- shape facts
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def embed_tokens(self) -> nn.Module:
        return self.stack["embed_tokens"]

    @property
    def hidden_size(self) -> int:
        e = self.embed_tokens
        return e.dims if isinstance(e, nn.QuantizedEmbedding) else e.weight.shape[1]

    @property
    def vocab_size(self) -> int:
        e = self.embed_tokens
        return e.num_embeddings if isinstance(e, nn.QuantizedEmbedding) else e.weight.shape[0]

    def embed(self, ids: mx.array) -> mx.array:
        """[B, L] ids -> [B, L, H]: exactly what the target's first layer receives, including
        any embedding scale of the family (Gemma multiplies by sqrt(H)), computed by the
        installed forward pass itself up to its first layer."""
        try:
            self._embed_view(ids, cache=None)
        except _FirstLayerInput as captured:
            return captured.x
        raise RuntimeError("the target's forward pass never reached its first layer")

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

    def head_rows(self, ids: mx.array):
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

    def forward(self, tokens: mx.array, cache: list) -> tuple[mx.array, mx.array]:
        logits = self._view(tokens, cache=cache)
        feats = mx.concatenate(self._store, axis=-1) if self.layer_ids else None
        return logits, feats

    def make_cache(self) -> list:
        """mlx-lm's cache for this model, with sliding-window caches made trimmable."""
        cache = make_prompt_cache(self.model)
        return [RollbackRotatingKVCache(c.max_size, c.keep)
                if type(c) is RotatingKVCache else c for c in cache]

    def check_rollback(self, cache: list) -> None:
        """Raise when some layer's cache can neither be trimmed nor replayed."""
        bad = sorted({type(c).__name__ for i, c in enumerate(cache)
                      if not c.is_trimmable() and not (i in self.recurrent
                                                       and isinstance(c, ArraysCache))})
        if bad:
            raise NotImplementedError(
                f"the target's cache ({', '.join(bad)}) cannot be rolled back after a partial "
                "acceptance; this target family is not supported")

    def snapshot(self, cache: list) -> "Snapshot":
        """Take before a verify; its `rollback` is the only way to drop rejected rows, so a
        rollback can never run without the state it needs."""
        return Snapshot(self, cache)


class Snapshot:
    """A target cache as it was before a verify: attention caches need only the row count;
    recurrent layers (which cannot be trimmed) keep their state (array references: cheap)."""

    def __init__(self, adapter: TargetAdapter, cache: list):
        self.adapter, self.cache = adapter, cache
        self.recurrent = {i: [list(s) if isinstance(s, list) else s for s in cache[i].state]
                          for i in adapter.recurrent}

    def rollback(self, kept: int, total: int) -> None:
        """Make every layer's cache what it would be had the verify fed only `kept` of its
        `total` rows."""
        if kept == total:
            return
        for i, c in enumerate(self.cache):
            if i in self.recurrent:
                c.state = self.recurrent[i]
                if kept:
                    # The installed layer over the kept rows updates the state exactly; its
                    # output is never evaluated, so only the recurrent part is computed.
                    self.adapter.layers[i](self.adapter.recorded_inputs[i][:, :kept], mask=None,
                                           cache=c)
            else:
                c.trim(total - kept)
