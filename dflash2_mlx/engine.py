"""The draft-verify loop (SPEC section 1), as a generator of committed token lists.

One cycle, with committed tokens x_1..x_n and the anchor x_n not yet seen by the target:
  draft   the drafter turns [x_n, M, ..., M] (w rows) into proposals d_1..d_{w-1}
  verify  the target runs [x_n, d_1, ..., d_{w-1}] and gives w rows of logits and features
  accept  greedy prefix match or rejection sampling -> a accepted drafts and one bonus token
  rollback  the target cache drops the w-1-a rejected rows (recurrent layers re-run the kept
          rows from their pre-verify state); rows 0..a of the features become the drafter's
          new context
Block width w = 1 is plain decoding (no drafter call). Everything but one host sync per cycle
(reading a and the tokens) stays on the device; the drafts are computed asynchronously while
the verify graph is being built.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Iterator

import mlx.core as mx

from .adaptive import AdaptiveWidth
from .drafter import Drafter
from .sampling import Sampling, greedy_accept, rejection_accept
from .target import TargetAdapter


@dataclass
class GenerationStats:
    """Figures of one generation. Times in seconds; tau counts the bonus token."""

    block_size: int | str = 0            # the fixed width, or "auto"
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    accepted: list[int] = field(default_factory=list)     # accepted drafts per drafting cycle
    widths: list[int] = field(default_factory=list)       # block width of each drafting cycle

    @property
    def cycles(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Mean acceptance length: accepted drafts + 1 per drafting cycle."""
        return sum(a + 1 for a in self.accepted) / len(self.accepted) if self.accepted else 1.0

    @property
    def mean_width(self) -> float:
        """Mean block width of the drafting cycles (differs from block_size with "auto")."""
        return sum(self.widths) / len(self.widths) if self.widths else 1.0

    @property
    def decode_tps(self) -> float:
        """Tokens per second after the first token (which prefill produces)."""
        return (self.generated_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def position_acceptance(self) -> list[float]:
        """P(draft k accepted | drafts < k accepted), k = 1..max width - 1."""
        rates = []
        for k in range(1, max(self.widths, default=1)):
            tried = sum(1 for a, w in zip(self.accepted, self.widths) if w > k and a >= k - 1)
            rates.append(sum(1 for a in self.accepted if a >= k) / tried if tried else 0.0)
        return rates

    def to_dict(self) -> dict:
        return {
            "block_size": self.block_size, "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens, "prefill_s": self.prefill_s,
            "decode_s": self.decode_s, "decode_tps": self.decode_tps, "cycles": self.cycles,
            "tau": self.tau, "mean_width": self.mean_width,
            "accepted_per_cycle": list(self.accepted), "widths": list(self.widths),
            "position_acceptance": self.position_acceptance,
        }


def prefill(target: TargetAdapter, prompt: list[int], cache: list, step: int,
            keep: int | None) -> tuple[mx.array, mx.array | None, int]:
    """Run the prompt through the target like mlx-lm does: prompt[:-1] in chunks of `step`,
    then the last token alone (its logits give the first new token).

    -> logits [1, V] of the last row, features [1, S, F] of the last S rows (S <= keep when
    `keep` is set, no features when keep == 0, all rows when None), and the number of leading
    rows whose features were dropped.
    """
    ids = mx.array(prompt, dtype=mx.uint32)[None]
    chunks: list[mx.array] = []
    bounds = [(s, min(s + step, len(prompt) - 1)) for s in range(0, len(prompt) - 1, step)]
    for start, end in bounds + [(len(prompt) - 1, len(prompt))]:
        logits, feats = target.forward(ids[:, start:end], cache)
        if feats is not None and keep != 0:
            chunks.append(feats)
            if keep is not None:
                chunks = [mx.concatenate(chunks, axis=1)[:, -keep:]]
        if end < len(prompt):
            mx.eval([c.state for c in cache], chunks)
            mx.clear_cache()
    feats = mx.concatenate(chunks, axis=1) if chunks else None
    dropped = len(prompt) - (feats.shape[1] if feats is not None else 0)
    return logits[:, -1], feats, dropped


def generate_tokens(target: TargetAdapter, drafter: Drafter | None, prompt: list[int], *,
                    max_tokens: int, sampling: Sampling, block_size: int,
                    stop_ids: set[int], seed: int | None = None,
                    prefill_step_size: int = 2048, policy: AdaptiveWidth | None = None,
                    stats: GenerationStats | None = None) -> Iterator[list[int]]:
    """Yield the tokens committed by prefill, then by each cycle, until a stop token (included)
    or `max_tokens`. Greedy output equals the target's own greedy decoding token for token.

    Block width: `block_size` every cycle, or, with a `policy`, its choice each cycle."""
    stats = stats if stats is not None else GenerationStats()
    stats.block_size, stats.prompt_tokens = "auto" if policy else block_size, len(prompt)
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    if max_tokens < 1:
        return
    drafting = drafter is not None and (block_size > 1 or policy is not None)
    cache = target.make_cache()
    if drafting:
        target.check_rollback(cache)
        dcache = drafter.make_cache()
    key = mx.random.key(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))

    tic = time.perf_counter()
    keep = drafter.context_window if drafting else 0
    logits, feats, dropped = prefill(target, prompt, cache, prefill_step_size, keep)
    if drafting:
        drafter.skip_context(dcache, dropped)
    key, k = mx.random.split(key)
    anchor = sampling.sample(logits, k).reshape(1, 1).astype(mx.uint32)
    tokens = anchor.reshape(-1).tolist()
    stats.prefill_s = time.perf_counter() - tic
    tic = time.perf_counter()
    stats.generated_tokens = 1
    yield list(tokens)
    n = 1
    pending = [feats] if drafting else []   # target features the drafter has not read yet

    while n < max_tokens and tokens[-1] not in stop_ids:
        cycle_tic = time.perf_counter()
        width = 1 if not drafting else min(policy.choose() if policy else block_size,
                                           max_tokens - n)
        key, k_draft, k_accept = mx.random.split(key, 3)
        if width > 1:
            ctx = mx.concatenate(pending, axis=1) if len(pending) > 1 else pending[0]
            pending = []
            proposal = drafter.propose(target, anchor, ctx, dcache, width, sampling, k_draft)
            drafts = proposal.tokens.astype(mx.uint32)                    # [1, w-1]
            # start drafting now: the device computes while Python builds the verify graph
            mx.async_eval(drafts, *(() if proposal.q is None else (proposal.q,)))
            verify_in = mx.concatenate([anchor, drafts], axis=1)          # [1, w]
        else:
            drafts, verify_in = mx.zeros((1, 0), mx.uint32), anchor
        snapshot = target.snapshot(cache) if width > 1 else {}
        logits, feats = target.forward(verify_in, cache)                  # [1, w, V], [1, w, F]
        if sampling.greedy:
            a, bonus = greedy_accept(drafts[0], mx.argmax(logits[0], axis=-1).astype(mx.uint32))
        else:
            V = logits.shape[-1]
            q = proposal.dense_q(V)[0] if width > 1 else mx.zeros((0, V))
            a, bonus = rejection_accept(drafts[0], sampling.probs(logits[0]), q, k_accept)
        mx.eval(a, bonus, drafts)
        a = a.item()
        new = drafts[0, :a].tolist() + [bonus.item()]
        target.rollback(cache, snapshot, a + 1, width)
        if drafting:
            pending.append(feats[:, : a + 1])
        if width > 1:
            stats.accepted.append(a)
            stats.widths.append(width)
        if policy is not None:
            policy.update(width, a, time.perf_counter() - cycle_tic)
        stop_at = next((i for i, t in enumerate(new) if t in stop_ids), None)
        if stop_at is not None:
            new = new[: stop_at + 1]
        tokens.extend(new)
        n += len(new)
        stats.generated_tokens = n
        stats.decode_s = time.perf_counter() - tic
        anchor = bonus.reshape(1, 1).astype(mx.uint32)
        yield new
        if n // 256 != (n - len(new)) // 256:
            mx.clear_cache()
