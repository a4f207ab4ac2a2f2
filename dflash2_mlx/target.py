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

# Where decoder stacks live in mlx-lm models: Model.model (llama, qwen2/3, mistral, ...),
# Model.language_model.model (multimodal wrappers such as qwen3_5, gemma3).
STACK_PATHS = (("model",), ("language_model", "model"), ("language_model",), ())


class LayerTap:
    """Calls one target layer and stores its output (the hidden state after that layer)."""

    def __init__(self, layer: nn.Module, slot: int, store: list):
        self.layer, self.slot, self.store = layer, slot, store

    def __call__(self, *args, **kwargs):
        out = self.layer(*args, **kwargs)
        self.store[self.slot] = out[0] if isinstance(out, tuple) else out
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


class TargetAdapter:
    """Logits plus concatenated hidden states of `layer_ids` from one forward of the target.

    `forward(tokens [B, T], cache)` -> (logits [B, T, V], features [B, T, len(layer_ids) * H]).
    """

    def __init__(self, model: nn.Module, layer_ids: tuple[int, ...] = ()):
        self.model = model
        self.path = find_stack_path(model)
        self.stack = self._descend(model, self.path)
        self.layers = self.stack["layers"]
        self.layer_ids = tuple(layer_ids)
        self._store: list = [None] * len(self.layer_ids)
        self._view = self._build_view()

    @staticmethod
    def _descend(model, path):
        for name in path:
            model = model[name]
        return model

    def _build_view(self) -> nn.Module:
        # Copy each module on the path so that swapping `layers` on the copy leaves the
        # original alone; parameters are shared, not copied.
        chain = [copy.copy(self.model)]
        for name in self.path:
            child = copy.copy(chain[-1][name])
            chain[-1][name] = child
            chain.append(child)
        layers = list(self.layers)
        for slot, i in enumerate(self.layer_ids):
            layers[i] = LayerTap(self.layers[i], slot, self._store)
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

    @property
    def embed_scale(self) -> float:
        """The factor the target multiplies its token embeddings by (Gemma: sqrt(H))."""
        model_type = str(getattr(getattr(self.model, "args", None), "model_type", ""))
        return self.hidden_size**0.5 if model_type.startswith("gemma") else 1.0

    # ---- compute
    def embed(self, ids: mx.array) -> mx.array:
        """[B, L] ids -> [B, L, H] embeddings as the target's first layer sees them."""
        x = self.embed_tokens(ids)
        return x * self.embed_scale if self.embed_scale != 1.0 else x

    def head(self, h: mx.array) -> mx.array:
        """The target's output projection: lm_head, or the tied embedding."""
        module = self.model
        for name in (None,) + self.path:   # Model.lm_head, Model.language_model.lm_head, ...
            module = module if name is None else module[name]
            if "lm_head" in module:
                return module["lm_head"](h)
        return self.embed_tokens.as_linear(h)

    def forward(self, tokens: mx.array, cache: list) -> tuple[mx.array, mx.array]:
        logits = self._view(tokens, cache=cache)
        feats = mx.concatenate(self._store, axis=-1) if self.layer_ids else None
        return logits, feats

    def make_cache(self) -> list:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)

    @staticmethod
    def check_trimmable(cache: list) -> None:
        bad = sorted({type(c).__name__ for c in cache if not c.is_trimmable()})
        if bad:
            raise NotImplementedError(
                f"the target's cache ({', '.join(bad)}) cannot be rolled back after a partial "
                "acceptance; this target family is not supported yet")

    @staticmethod
    def trim(cache: list, n: int) -> None:
        """Drop the last n positions (rejected drafts) from every layer's cache."""
        if n > 0:
            for c in cache:
                c.trim(n)
