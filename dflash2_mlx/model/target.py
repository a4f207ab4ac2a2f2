"""The target interface the engine, the drafter and the server use (`Target`), and its
single-process implementation (`TargetAdapter`): logits plus the hidden states of chosen layers
from one forward of an mlx-lm model.

We never patch mlx-lm classes nor the user's model: the adapter runs the model through a view
(`views`) whose layers are taps that call the real layers and record their outputs, so its
logits are the model's own (checked at load time and in the tests). The pipeline-sharded
targets (`distributed.ShardedTarget`, `distributed.FollowerTarget`) implement the same protocol
from the same views.
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import mlx.core as mx
import mlx.nn as nn

from .inputs import ImageRows, Inputs, CurrentInputs, image_layers
from .row_caches import RaggedRows, batch_refusal
from .views import (STACK_PATHS, KVQuant, LayerRange, LayerTap, RollbackRotatingKVCache,
                    Snapshot, TargetModel, check_kv, find_stack_path)


@runtime_checkable
class Target(Protocol):
    """What a target offers the engine (forward, caches, rollback), the drafter (embedding and
    head) and the loaders (shapes). Shapes: B batch, T rows, H hidden, V vocabulary,
    F = len(layer_ids) * H."""

    layer_ids: tuple[int, ...]          # the layers whose outputs `forward` returns, in order

    @property
    def hidden_size(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def tappable(self) -> int:
        """The layer ids a drafter may tap are 0..tappable-1 (num_layers, but for a looped
        stack its unrolled steps: `views.LayerRange`)."""

    def forward(self, tokens: mx.array, cache: list, inputs: Inputs | None = None
                ) -> tuple[mx.array, mx.array | None]:
        """tokens [B, T] -> (logits [B, T, V], features [B, T, F] or None without layer_ids);
        appends the rows to `cache`. inputs: the rows' embeddings and positions where an
        image is (`inputs.Inputs`; `TargetAdapter` takes them, a pipeline-sharded target,
        which refuses images, does not)."""

    def make_cache(self) -> list:
        """A new, empty cache for `forward`."""

    def check_rollback(self, cache: list) -> None:
        """Raise NotImplementedError when some layer of `cache` cannot be rolled back."""

    def batch_refusal(self) -> str | None:
        """Why its caches cannot hold a batch's ragged rows (then it decodes one sequence at
        a time), or None."""

    def batch_rows(self) -> RaggedRows:
        """An empty row set for a batch on its caches (when `batch_refusal()` is None)."""

    def snapshot(self, cache: list) -> Snapshot:
        """Take before a verify; its `rollback(kept, total)` drops the rejected rows."""

    def embed(self, ids: mx.array) -> mx.array:
        """ids [B, L] -> [B, L, H], what the first layer receives."""

    def head(self, h: mx.array) -> mx.array:
        """[..., H] -> logits [..., V]."""

    def head_rows(self, ids: mx.array) -> Callable[[mx.array], mx.array]:
        """The head restricted to vocabulary rows `ids`: [..., H] -> [..., len(ids)]."""


def rollback_error(bad: list[str]) -> NotImplementedError:
    return NotImplementedError(
        f"the target's cache ({', '.join(bad)}) cannot be rolled back after a partial "
        "acceptance; this target family is not supported")


class TargetAdapter(TargetModel):
    """`Target` for a model in this process.

    `forward(tokens [B, T], cache)` -> (logits [B, T, V], features [B, T, len(layer_ids) * H]).
    Also what the trainer reads: `model`, `stack`, `layers`, `head_module()`. kv: the
    full-attention layers' caches quantized (`views.KVQuant`), checked against the model now.
    images: what a vision-language family needs inside its stack (`inputs.ImageRows`: Qwen's
    multimodal rope, Gemma 4's two-way image attention, Qwen3-VL's DeepStack): the model then
    runs through a view whose layers take `Inputs` (`inputs.image_layers`).
    """

    def __init__(self, model: nn.Module, layer_ids: tuple[int, ...] = (),
                 kv: KVQuant | None = None, images: ImageRows | None = None):
        self.current_inputs = CurrentInputs()
        if images:
            whole = TargetModel(model)
            model = whole.view(image_layers(whole.layers, images, self.current_inputs))
        super().__init__(model, kv)
        if kv is not None:
            check_kv(model, kv)
        self.layer_ids = tuple(layer_ids)
        self.batch_why: str | None = None      # why it must not batch (`Pipeline.check_rows`)
        self.range = LayerRange(self, 0, self.num_layers, self.layer_ids)
        self._view = self.range.view()

    def forward(self, tokens: mx.array, cache: list, inputs: Inputs | None = None
                ) -> tuple[mx.array, mx.array | None]:
        self.range.calls.clear()
        if inputs is None:
            logits = self._view(tokens, cache=cache)
        else:
            self.current_inputs.inputs = inputs
            try:
                logits = (self._view(tokens, cache=cache) if inputs.embeds is None else
                          self._view(tokens, cache=cache, input_embeddings=inputs.embeds))
            finally:
                self.current_inputs.inputs = None
        outputs = self.range.outputs
        feats = (mx.concatenate([outputs[i] for i in self.layer_ids], axis=-1)
                 if self.layer_ids else None)
        return logits, feats

    def use_kernels(self, record, kernels=None) -> None:
        """Run `forward` through the custom verify kernels where `record` (the probe's
        `kernel_probe.KernelRecord`) chose them (`kernel_view`); `kernels`: the callables
        (`kernel_view.VerifyKernels`), by default the Metal ones where Metal runs. Otherwise
        (record None, every class stock, no Metal) the view of the model's own modules, as
        built at load. Call it between forwards (not between a snapshot and its rollback):
        the taps record into a new range."""
        from .kernel_view import kernel_model, metal_kernels
        from .kernels import metal_usable

        if kernels is None and metal_usable():
            kernels = metal_kernels()
        routed = (kernel_model(self.model, record, kernels, self.kv) if kernels is not None
                  else self.model)
        if routed is self.model and self.range.target is self:
            return                                   # stock, as loaded: nothing to rebuild
        target = self if routed is self.model else TargetModel(routed, self.kv)
        self.range = LayerRange(target, 0, self.num_layers, self.layer_ids)
        self._view = self.range.view()

    def check_rollback(self, cache: list) -> None:
        bad = self.range.unrollable(cache)
        if bad:
            raise rollback_error(bad)

    def batch_refusal(self) -> str | None:
        return self.batch_why or batch_refusal(self.make_cache())

    def batch_rows(self) -> RaggedRows:
        return RaggedRows()

    def snapshot(self, cache: list) -> Snapshot:
        """Take before a verify; its `rollback` is the only way to drop rejected rows, so a
        rollback can never run without the state it needs."""
        return self.range.snapshot(cache)


__all__ = ["Target", "TargetAdapter", "KVQuant", "Snapshot", "LayerTap",
           "RollbackRotatingKVCache", "STACK_PATHS", "find_stack_path"]
