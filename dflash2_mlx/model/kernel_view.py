"""The target's forward through the custom verify kernels (docs/kernels.md, "How they are wired").

`kernel_model(model, record, kernels)` returns a view of an mlx-lm model: a shallow copy of
the modules on the path to each routed module (every parameter shared; the user's model and
mlx-lm's classes untouched) in which, for the shape classes the probe's `KernelRecord` marks
custom,

- a 4- or 8-bit affine `nn.QuantizedLinear` is a `KernelLinear`: inputs of at most 16 rows go
  through `kernels.qmm` (the small-M quantized matmul), wider ones (a prefill) through the layer;
- the attention of the llama (mistral), qwen2 and qwen3 families is a `KernelAttention`: the
  family's own forward (projections, q/k norms, rope, the cache's `update_and_fetch`) with
  `kernels.attention` in place of `scaled_dot_product_attention` for at most 16 rows over a
  plain `KVCache` (or, `kernels.quantized_attention`, mlx-lm's `QuantizedKVCache`) under the
  causal mask, and over the batch engine's ragged caches (`RaggedKVCache`,
  `RaggedQuantizedKVCache`, no sliding window) with each slot's position read from the cache
  (`key_positions`); anything else (a prefill, a sliding-window cache) runs the stock
  attention.

Plain steps (1 row) and verifies (2-16 rows) take the same path, so a row's bits do not depend
on the width it runs at. Where nothing is routed the model itself comes back, not a copy.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from .. import log
from .row_caches import RaggedKVCache, RaggedQuantizedKVCache
from .kernel_probe import KernelRecord, attention_class, qmm_class
from .kernels import metal, ops

_log = log.get(__name__)

MAX_ROWS = metal.QMM_MAX_ROWS      # rows a verify kernel takes (both kernels: 16)


@dataclass(frozen=True)
class VerifyKernels:
    """The callables a kernel view runs (injected: the Metal launchers, the MLX-ops twins, or a
    test's harness-compiled kernels).

    attention(q [B, Hq, T, D], k, v [B, Hkv, N, D], scale, positions=None) -> [B, Hq, T, D],
    rows the last T positions under the causal mask, or, positions [B, N] given, under the
    ragged rows' mask (`ops.verify_mask`); qmm(x [..., K], w, scales, biases, group_size, bits)
    -> [..., N]; quantized_attention(q, keys, values, scale, group_size=, bits=, positions=)
    over a quantized cache's (words, scales, biases) tuples, or None: stock over quantized
    caches."""

    attention: Callable
    qmm: Callable
    quantized_attention: Callable | None = None


def metal_kernels() -> VerifyKernels:
    """The Metal launchers of `metal_kernels/metal.py` (what runs on a Mac)."""
    return VerifyKernels(metal.verify_attention_metal, metal.small_m_qmm_metal,
                         metal.verify_attention_quant_metal)


def ops_kernels() -> VerifyKernels:
    """The MLX-ops twins (`metal_kernels/ops.py`): the contracts, runnable anywhere."""
    return VerifyKernels(ops.verify_attention_ops, ops.small_m_qmm_ops,
                         ops.verify_attention_quant_ops)


@functools.cache
def attention_families() -> tuple[type, ...]:
    """The mlx-lm attention classes whose forward `KernelAttention` reproduces (mistral loads as
    llama): q/k/v/o projections, optional q_norm/k_norm per head, rope at the cache offset."""
    from mlx_lm.models import llama, qwen2, qwen3

    return (llama.Attention, qwen2.Attention, qwen3.Attention)


class _Wrapper(nn.Module):
    """A module standing for `inner` (a child, so its parameters stay visible); attributes it
    lacks are read from `inner`, as `views.LayerTap`'s are from its layer."""

    def __init__(self, inner: nn.Module, kernels: VerifyKernels):
        super().__init__()
        self.inner = inner
        self.kernels = kernels

    def __getattr__(self, name):
        if name in self:
            return self[name]
        if "inner" not in self:
            raise AttributeError(name)
        return getattr(self["inner"], name)


class KernelLinear(_Wrapper):
    """An affine 4/8-bit `nn.QuantizedLinear` through `kernels.qmm` for <= 16 rows; the
    layer's own bias added after, as `QuantizedLinear.__call__` does."""

    def __call__(self, x):
        lin = self["inner"]
        if x.size > MAX_ROWS * x.shape[-1]:
            return lin(x)
        y = self.kernels.qmm(x, lin["weight"], lin["scales"], lin["biases"], lin.group_size,
                             lin.bits)
        return y + lin["bias"] if "bias" in lin else y


class KernelAttention(_Wrapper):
    """The forward of an `attention_families()` module with the verify kernel as its attention
    (`inner`: the module, its projections possibly `KernelLinear`s)."""

    def __call__(self, x, mask=None, cache=None):
        a = self["inner"]
        B, L, _ = x.shape
        q, k, v = a.q_proj(x), a.k_proj(x), a.v_proj(x)
        q, k = q.reshape(B, L, a.n_heads, -1), k.reshape(B, L, a.n_kv_heads, -1)
        if "q_norm" in a:                                    # qwen3: RMSNorm per head
            q, k = a.q_norm(q), a.k_norm(k)
        q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        v = v.reshape(B, L, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if cache is not None:
            q, k = a.rope(q, offset=cache.offset), a.rope(k, offset=cache.offset)
            k, v = cache.update_and_fetch(k, v)
        else:
            q, k = a.rope(q), a.rope(k)
        out = self.attend(q, k, v, mask, cache)
        return a.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def attend(self, q, k, v, mask, cache):
        """The verify kernel where its contract holds (<= 16 rows, the last of the cache's keys,
        causal; or a ragged cache's rows, the mask its `make_mask` made), else mlx-lm's stock
        attention with the mask the forward made."""
        a, T = self["inner"], q.shape[2]
        quantized = self.kernels.quantized_attention
        if T <= MAX_ROWS and type(cache) in (RaggedKVCache, RaggedQuantizedKVCache) and \
                cache.window is None and isinstance(mask, mx.array):
            positions = key_positions(cache, T)
            if positions.shape[1] == (k[0] if isinstance(k, tuple) else k).shape[2]:
                if type(cache) is RaggedKVCache:
                    return self.kernels.attention(q, k, v, a.scale, positions=positions)
                if quantized is not None:
                    return quantized(q, k, v, a.scale, group_size=cache.group_size,
                                     bits=cache.bits, positions=positions)
        causal = mask is None if T == 1 else isinstance(mask, str) and mask == "causal"
        if causal and T <= MAX_ROWS:
            if type(cache) is KVCache:
                return self.kernels.attention(q, k, v, a.scale)
            if type(cache) is QuantizedKVCache and quantized is not None:
                return quantized(q, k, v, a.scale, group_size=cache.group_size, bits=cache.bits)
        return scaled_dot_product_attention(q, k, v, cache=cache, scale=a.scale, mask=mask)


def key_positions(cache: RaggedKVCache, T: int) -> mx.array:
    """[B, N] int32: the position of each key slot of a ragged cache's rows once a step has
    written its T slots (`pos`, -1 a hole, then each row's next T positions from `lengths`),
    the numbers its `make_mask` builds the step's mask from."""
    new = cache.lengths[:, None] + np.arange(T)[None]
    return mx.array(np.concatenate([cache.pos, new], axis=1).astype(np.int32))


# --------------------------------------------------------------------------- the view


_said: set[str] = set()


def _say_stock(what: str, why: str) -> None:
    """One log line per process and kind of module left stock although its class is custom."""
    if what not in _said:
        _said.add(what)
        _log.info(f"verify kernels: {what} stays stock ({why})")


def _route(record: KernelRecord, kernels: VerifyKernels, kv, original: nn.Module,
           rewritten: nn.Module) -> nn.Module:
    """What stands for `original` in the view (`rewritten`: it with its children routed; `kv`:
    the target's KV quantization, which makes full attention's class the quantized one)."""
    shape = qmm_class(original)
    if shape is not None:
        return KernelLinear(original, kernels) if record.uses_custom(shape) else rewritten
    shape = attention_class(original, kv)
    if shape is None or not record.uses_custom(shape):
        return rewritten
    name = type(original).__module__.rsplit(".", 1)[-1] + "." + type(original).__name__
    if type(original) not in attention_families():
        _say_stock(f"attention {name}", "not a llama / qwen2 / qwen3 attention")
    elif shape.dims[2] not in metal.ATTN_HEAD_DIMS:
        _say_stock(f"attention {name} head dim {shape.dims[2]}", "the kernel takes multiples "
                   "of 32 up to 256")
    else:
        return KernelAttention(rewritten, kernels)
    return rewritten


def _rewrite(module: nn.Module, route: Callable) -> nn.Module:
    """`route(module, copy)`, where copy is `module` itself when none of its children (modules,
    lists of modules) changed, else a shallow copy holding the changed ones."""
    changed = {}
    for name, child in module.items():
        if isinstance(child, nn.Module):
            new = _rewrite(child, route)
        elif isinstance(child, list) and any(isinstance(c, nn.Module) for c in child):
            new = [_rewrite(c, route) if isinstance(c, nn.Module) else c for c in child]
            new = child if all(a is b for a, b in zip(new, child)) else new
        else:
            continue
        if new is not child:
            changed[name] = new
    out = module
    if changed:
        out = copy.copy(module)
        for name, new in changed.items():     # items, not `Module.update` (parameters only)
            out[name] = new
    return route(module, out)


def kernel_model(model: nn.Module, record: KernelRecord | None,
                 kernels: VerifyKernels, kv=None) -> nn.Module:
    """`model` with the classes `record` marks custom routed through `kernels` (module doc);
    `model` itself where nothing is (record None, or every class stock). kv: the target's
    `views.KVQuant` (None: a float cache)."""
    if record is None or not any(d.custom for d in record.decisions.values()):
        return model
    return _rewrite(model, functools.partial(_route, record, kernels, kv))


def routed_modules(model: nn.Module) -> list[str]:
    """Names of the modules of a view that run a kernel (for tests and `doctor`-like reports)."""
    return [name for name, m in model.named_modules() if isinstance(m, _Wrapper)]
