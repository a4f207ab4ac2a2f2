"""Whether the target's forward gives a row the same bits however many rows run beside it.

With a quantized KV cache this decides exactness. A key computed in a verify of T rows, or in
a batch, that differs from plain decoding's in its last bit can round to another 8- or 4-bit
code; the step of one code then moves logits by up to ~0.1 (SmolLM2, float32 weights on the
CPU), and greedy near-ties flip that float caches, ~1e-4 apart, never reach. A forward whose
every row is bitwise independent of the others (quantized weights on MLX's CPU backend, the
custom kernels on a Mac) stores the codes plain decoding stores. docs/decisions.md.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from .state import DecodeState

CONTEXT = (37, 21)          # the two sequences' random prompts: different lengths, odd
ROWS = 8                    # rows of the verify checked against as many plain steps


class RowCheck(NamedTuple):
    """What differed (None: nothing): `verify`, a forward of ROWS rows against ROWS plain
    steps of one sequence; `batch`, two sequences of different lengths stepped together
    against each alone."""
    verify: str | None
    batch: str | None


def check_rows(target) -> RowCheck:
    """Both checks on random tokens (seeded; a few dozen forwards at a short context)."""
    keys = mx.random.split(mx.random.key(7), len(CONTEXT) + 1)
    vocab = target.vocab_size
    prompts = [mx.random.randint(0, vocab, (1, n), key=k) for n, k in zip(CONTEXT, keys)]
    rows = mx.random.randint(0, vocab, (len(CONTEXT), ROWS), key=keys[-1])
    states = []
    for p in prompts:
        s = DecodeState.new(target, None)
        target.forward(p, s.cache)
        mx.eval([c.state for c in s.cache])
        states.append(s)
    steps = [_steps(target, states[0].copy(), rows[:1])]                      # [1, ROWS, V]
    block, _ = target.forward(rows[:1], states[0].copy().cache)
    verify = _differs(block, steps[0], f"a forward of {ROWS} rows")
    batch = None
    if target.batch_refusal() is None:
        steps += [_steps(target, s.copy(), r[None]) for s, r in zip(states[1:], rows[1:])]
        together = target.batch_rows()
        together.join([s.copy() for s in states])
        stepped = []
        for i in range(ROWS):
            logits, _ = target.forward(rows[:, i:i + 1], together.cache)
            together.kept([1] * len(states), 1)
            stepped.append(logits)
        batch = _differs(mx.concatenate(stepped, axis=1), mx.concatenate(steps),
                         f"{len(states)} sequences stepped as a batch")
    return RowCheck(verify, batch)


def _steps(target, state: DecodeState, tokens: mx.array) -> mx.array:
    """tokens [1, n] one at a time -> logits [1, n, V]."""
    out = [target.forward(tokens[:, i:i + 1], state.cache)[0] for i in range(tokens.shape[1])]
    return mx.concatenate(out, axis=1)


def _differs(got: mx.array, plain: mx.array, what: str) -> str | None:
    if mx.array_equal(got, plain).item():
        return None
    gap = mx.abs(got.astype(mx.float32) - plain.astype(mx.float32)).max().item()
    return f"{what} gave logits up to {gap:.2g} away from plain steps"
