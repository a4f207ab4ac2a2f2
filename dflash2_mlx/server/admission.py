"""The scheduler's admission and memory accounting: whether a queued job joins now, waits for
memory or never fits (`_room_for`), how many prompt tokens a step prefills (`prefill_budget`,
bounded by what the budget leaves: `_peak_bound`), the prefix cache kept within what the running
sequences leave (`_make_room`), a finished sequence's state copied only where it fits
(`_room_for_state`), MLX's peak read around every step, and a job ended by an allocation
failure. `MemoryAdmission` is the `Scheduler`'s base: it reads the scheduler's budget
(`memory`), prefix cache, engine and running jobs. docs/server.md, "Memory".
"""

from __future__ import annotations

import logging

import mlx.core as mx

from .. import log as logs
from ..decode.engine import Engine
from ..model import memory as mem
from .budget import engine_bytes

log = logs.get("dflash2_mlx.server.scheduler")     # one logger for the scheduler's lines

ADMIT, WAIT = "admit", "wait"            # `_room_for`: a job joins now, or waits for memory
# the longest a step's prefill should take: a departed client's prompt holds the model no longer
PREFILL_SECONDS = 1.0
MIN_PREFILL = 16        # prompt tokens a step prefills at least (~1.7 s after 20k on this CPU)
FIRST_PREFILL = 256     # prompt tokens of the first step, before any rate is known (~1 s here)


def request_length(request) -> int:
    """The most tokens a request's caches may hold: its prompt plus its max_tokens."""
    return len(request.prompt) + request.max_tokens


def image_bytes(request) -> int:
    """What a request's images hold while its prefill computes their rows (the tower's
    activations, the rows' embeddings: `model.vision.Media.transient_bytes`)."""
    media = getattr(request, "media", None)
    return 0 if media is None else media.transient_bytes


class MemoryAdmission:
    """Admission, prefill sizes and memory accounting of a `Scheduler` (its base class)."""

    def _publish_memory(self, engine: Engine | None = None) -> None:
        """/health's "memory": the budget, the weights, the caches' bytes in use and
        reserved, the prefix cache's, the requests waiting for memory, the finished
        sequences' states not kept for the prefix cache for want of room, MLX's active and
        peak bytes."""
        m = self.memory
        if m is not None:
            held, reserved = self._cache_bytes(engine) if engine else (0, 0)
            self.memory_figures = {
                **m.describe(), "kv_in_use": held, "kv_reserved": reserved,
                "prompt_cache": self._cached(),
                "waiting_for_memory": self.waiting if self._held is not None else 0,
                "states_not_kept": self.states_not_kept,
                "active": mx.get_active_memory(), "peak": self._peak()}

    def _room_for(self, job) -> str:
        """ADMIT when the job's caches, and its join's copies, fit beside the running ones
        (the prefix cache's RAM entries evicted, least recently used first, as far as
        needed), WAIT when they will once some leave, else why they never fit."""
        m = self.memory
        if m is None:
            return ADMIT
        lengths = self._lengths() + [request_length(job.request)]
        images = image_bytes(job.request)
        if m.need(lengths) + images > m.room:
            return WAIT if self._decoding else m.too_long(request_length(job.request), images)
        short = self._over(lengths) + m.join_bytes(lengths) + images
        if short > 0 and self._cached():
            self._evict(short, "a request")
            short = self._over(lengths) + m.join_bytes(lengths) + images
        # memory MLX holds beyond the model's count waits for running sequences to leave;
        # alone, the request runs (nothing else would free it)
        return WAIT if short > 0 and self._decoding else ADMIT

    def _over(self, lengths: list[int]) -> int:
        """The bytes by which sequences of these lengths (prompt + max_tokens), the prefix
        cache and what the count misses (`_beyond_count`) exceed the budget's room."""
        m = self.memory
        return m.need(lengths) + self._cached() + self._beyond_count() - m.room

    def _evict(self, nbytes: int, why: str) -> None:
        """Prefix-cache entries out, least recently used first, until `nbytes` are freed."""
        freed = self.prompt_cache.evict(nbytes)
        log.info(f"memory: {mem.gib(freed)} of prefix-cache entries evicted to make room for "
                 f"{why}")
        self._publish()

    def _joining(self) -> int:
        """The room a join still to come holds (admission counted it; a prefill may take
        several steps)."""
        queued = self._engine is not None and self._engine.queue
        return self.memory.join_bytes(self._lengths()) if queued else 0

    def _make_room(self) -> None:
        """The prefix cache within what the running sequences leave of the budget: their
        reservations, what the count misses (`_beyond_count`) and a join to come."""
        if self.memory is not None and self._cached():
            short = self._over(self._lengths()) + self._joining()
            if short > 0:
                self._evict(short, "the running sequences")

    def _room_for_state(self, nbytes: int) -> bool:
        """Whether a finished sequence's state, `nbytes` copied out of the batch for the
        prefix cache, fits in the budget now beside a decoding step's rise (prefix-cache
        entries evicted to make room); the engine does not copy it otherwise."""
        def short() -> int:
            return (mx.get_active_memory() + nbytes + self._step_rise + self._joining()
                    - self.memory.limit)

        if short() > 0 and self._cached():
            self._evict(short(), "a finished sequence's state")
        if short() <= 0:
            return True
        self.states_not_kept += 1
        log.info(f"memory: a finished sequence's state ({mem.gib(nbytes)}) is not kept for the "
                 "prefix cache: the budget has no room for its copy")
        return False

    def _beyond_count(self, rise: bool = True, cache: tuple[int, int] | None = None) -> int:
        """What the budget's count misses, measured: MLX's active bytes beyond the weights,
        the prefix cache and the running sequences' reservations (or their caches, where
        those hold more), the caches held beyond their reservation, plus (`rise`) the most a
        decoding step has added above its start (its transients; a prefill's are
        `_peak_bound`'s). Admissions and prefill steps leave room for it, so the budget
        bounds what MLX holds, not only what it models. cache: `_cache_bytes()`, if known."""
        held, reserved = cache or self._cache_bytes()
        over = max(0, mx.get_active_memory() - self.memory.weights - self._cached()
                   - max(held, reserved))
        return over + max(0, held - reserved) + (self._step_rise if rise else 0)

    def _cache_bytes(self, engine: Engine | None = None) -> tuple[int, int]:
        """(bytes the running sequences' caches hold, bytes their reservations reach)."""
        return (engine_bytes(self._engine if engine is None else engine),
                self.memory.need(self._lengths()))

    def _peak(self) -> int:
        """MLX's peak memory since serving began (`_step` resets MLX's own each step)."""
        return max(self._peak_before, mx.get_peak_memory())

    def _lengths(self) -> list[int]:
        """The lengths the admitted jobs may reach (prompt + max_tokens)."""
        return [request_length(job.request) for job, _ in self._decoding.values()]

    def _cached(self) -> int:
        return self.prompt_cache.nbytes if self.prompt_cache is not None else 0

    def _mark_step(self) -> int:
        """MLX's active bytes as a step starts, its peak counter reset (the peak so far kept
        for /health), so that the step's own rise can be read after it. With a budget, the
        freed buffers MLX keeps for reuse are held to what the budget leaves beside them
        (or MLX's own limit, where that is less: 32 MiB on the CPU)."""
        self._note_peak("between steps (cancels, the prefix cache's fetches and inserts)", 0)
        self._peak_before = self._peak()
        mx.reset_peak_memory()
        active = mx.get_active_memory()
        if self.memory is not None:
            mx.set_cache_limit(max(0, min(self._cache_default, self.memory.limit - active)))
        return active

    def _note_peak(self, where: str, start: int) -> None:
        """A debug line where MLX's peak since serving began rose (`serve --verbose`): what a
        budget's user reads to see which step made it."""
        peak = mx.get_peak_memory()
        if self.memory is not None and peak > self._peak_before and log.isEnabledFor(logging.DEBUG):
            log.debug(f"memory: peak {peak / 2**20:.1f} MiB {where}, from {start / 2**20:.1f}"
                      f" MiB (budget {self.memory.limit / 2**20:.1f} MiB)")
        self._peak_before = max(self._peak_before, peak)     # said once

    def _peak_bound(self, budget: int) -> int:
        """At most the prompt tokens whose attention scores fit in what the budget has left
        (`MemoryBudget.prefill_tokens`, at the longest waiting prompt's context): a step's
        peak stays within the budget, not only its caches."""
        engine, m = self._engine, self.memory
        if m is None or not engine.queue:
            return budget
        context = max(len(seq.req.prompt) for seq in engine.queue)
        # the caches as they are now, and what the count misses (their slack beyond the
        # reservation counted once more: without it a 2k-token load peaked 1.5% over); no
        # step launched ahead runs beside a prefill (`Engine.admit` waits for it)
        cache = self._cache_bytes()
        free = m.room - cache[0] - self._cached() - self._beyond_count(False, cache)
        return min(budget, m.prefill_tokens(free, context))

    def _out_of_memory(self, job, e: BaseException) -> None:
        """A job ended by an allocation failure: its client is told, in words that name
        memory; the prefix cache's RAM entries go (to disk, with a disk tier)."""
        if self.memory is not None:
            self.memory.failures += 1
        if self.prompt_cache is not None:
            self.prompt_cache.evict(self.prompt_cache.nbytes)
        log.warning(f"out of memory: a generation was ended so that the others go on ({e})")
        job.emit({"error": "out of memory: the server ended this generation so that the "
                  f"others could go on ({e}); retry later, or start the server with a smaller "
                  "--memory-budget, --kv-bits 8 or 4, or a lower --context-length",
                  "status": 503})
        self._carried.pop(id(job), None)
        self._done(job)
        mx.clear_cache()

    def prefill_budget(self, running: int, waiting: int, step_size: int,
                       last: tuple[int, float] | None = None) -> int:
        """Prompt tokens one step prefills: a lone prompt in the pipeline's chunks
        (`step_size`), as alone; beside running streams `prefill_chunk` per request that can
        join this step, so that the streams keep flowing and a burst of joiners (agents
        coming back with short new turns) joins in as few steps as one joiner would, as
        mlx-lm prefills its joiners together (at most `step_size`, one chunk's worth).
        Either way at most what `PREFILL_SECONDS` holds at the rate of the last step's
        prefill (`last`: tokens, seconds; (0, 0.0) before the first, which prefills at most
        `FIRST_PREFILL`), so that a client that leaves during a long prompt frees the model
        within a step."""
        if not running:
            budget = step_size
        else:
            joining = max(1, min(waiting, self.rows - running))
            budget = max(self.prefill_chunk, min(self.prefill_chunk * joining, step_size))
        if last is None:
            return budget
        tokens, seconds = last
        if not tokens:
            return min(budget, FIRST_PREFILL)
        if seconds > 0:
            budget = min(budget, max(MIN_PREFILL, int(PREFILL_SECONDS * tokens / seconds)))
        return budget
