"""Softmax through numpy's vectorised `exp` for training on MLX's CPU backend.

MLX's CPU `exp` costs ~11 ns per element here against ~0.5 ns for numpy's (SIMD) one, and a
training step's softmaxes (the head's over the draft vocabulary, the attention's over the
context) are tens of millions of elements. On the CPU backend an MLX array is a numpy view
without a copy, so the forward runs in numpy and comes back as one copy; the gradient stays in
MLX (p * (g - sum(g * p)): no exp). Other backends, and traced code (`mx.compile`, under
`disabled()`), use `mx.softmax`. Evaluation inside the forward is allowed under `mx.grad`.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx
import numpy as np

_off = 0


@contextlib.contextmanager
def disabled():
    """Use `mx.softmax` inside (for code that `mx.compile` traces)."""
    global _off
    _off += 1
    try:
        yield
    finally:
        _off -= 1


def active() -> bool:
    return not _off and mx.default_device() == mx.cpu


def _numpy(x: mx.array) -> np.ndarray:
    """x evaluated, as a float32 numpy view of the same memory (CPU backend)."""
    x = x.astype(mx.float32)
    mx.eval(x)
    return np.asarray(memoryview(x))


def softmax_forward(x: mx.array) -> mx.array:
    """softmax over the last axis, float32, without a gradient of its own."""
    if not active():
        return mx.softmax(x, axis=-1, precise=True)
    a = _numpy(x)
    out = a - a.max(-1, keepdims=True)
    np.exp(out, out=out)
    out /= out.sum(-1, keepdims=True)
    return mx.array(out)


@mx.custom_function
def softmax(x: mx.array) -> mx.array:
    """softmax over the last axis (the drop-in for `mx.softmax(x, axis=-1, precise=True)`)."""
    return softmax_forward(x)


@softmax.vjp
def _softmax_vjp(primals, cotangent, p):
    return (p * (cotangent - (cotangent * p).sum(-1, keepdims=True)),)


@mx.custom_function
def swiglu(gate: mx.array, up: mx.array) -> tuple[mx.array, mx.array]:
    """(silu(gate) * up, sigmoid(gate)): mlx-lm's `swiglu`, its sigmoid kept for the gradient
    (which carries none of its own)."""
    if not active():
        sig = mx.sigmoid(gate)
    else:
        s = np.negative(_numpy(gate))
        np.exp(s, out=s)
        s += 1.0
        np.reciprocal(s, out=s)
        sig = mx.array(s)
    return gate * sig * up, sig


@swiglu.vjp
def _swiglu_vjp(primals, cotangents, outputs):
    gate, up = primals
    sig, dout = outputs[1], cotangents[0]
    silu = gate * sig
    return dout * up * (sig + silu * (1 - sig)), dout * silu
