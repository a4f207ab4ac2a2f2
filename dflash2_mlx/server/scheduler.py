"""The generation queue: `Scheduler` owns the model on its worker thread; the HTTP side only
submits jobs and reads their events.

One loop on `engine.Engine`: continuous batching (every running request advances in one
target forward per step, each still speculating; a request joins at any step, its prefill
chunked under a per-step budget), one request at a time ("single") where the engine says the
target cannot batch (`model.row_caches.batch_refusal`) or max_batch is 1.
docs/server.md, "Batching".

With a `budget.MemoryBudget`, a request joins only when its caches, at its prompt plus its
max_tokens, fit beside the running ones (the prefix cache's RAM entries are evicted first to
make room); otherwise it waits at the head of the queue. A step that still fails to allocate
ends only the sequence that must end (`admission.MemoryAdmission`, the scheduler's base).
docs/server.md, "Memory".
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass, field

import mlx.core as mx

from .. import log as logs, settings as check
from ..model import memory as mem
from ..decode.engine import FAILED, Engine
from ..decode.stats import GenerationStats
from ..pipeline import Pipeline, SequenceText
from ..model.sampling import Sampling
from ..model.vision import Media
from .admission import ADMIT, WAIT, MemoryAdmission, request_length
from .budget import MemoryBudget

log = logs.get(__name__)

BATCH, SINGLE = "batch", "single"


@dataclass
class GenerationRequest:
    """What the model runs: prompt ids and sampling; stop strings and tools stay in HTTP."""

    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    seed: int | None = None
    # a prompt position the prefix cache keeps a state at too (`Service.checkpoint`)
    checkpoint: int | None = None
    media: Media | None = None          # the prompt's images (`model.vision.Media`)


@dataclass
class Job:
    """One request's place in the queue and its channel back to the HTTP handler."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    why: str | None = None       # "client" (it left), "stop" (a stop string), "done", "shutdown"
    cached_tokens: int | None = None     # prompt tokens from the prefix cache, once started

    def cancel(self, why: str = "client") -> None:
        """Stop at the next cycle; the first reason given is kept."""
        if not self.cancelled.is_set():
            self.why = why
            self.cancelled.set()

    def emit(self, event: dict) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:      # the event loop is gone (shutdown): nobody is listening
            pass


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


class NeverFits(Exception):
    """A request whose caches exceed the memory budget even alone; str(): why, in numbers."""


SHUTDOWN = "the server is shutting down"


class Scheduler(MemoryAdmission):
    """Requests wait in a bounded first-in first-out queue; one worker thread owns the model,
    so MLX never runs on two threads. Batch mode: the worker admits queued jobs into the engine
    while fewer than `rows` run (`max_batch`, or 1 where the engine decodes one at a time),
    and steps it (`prefill_chunk` prompt tokens per step while others decode).

    The HTTP layer only calls `submit` and reads `Job.events` (dicts: {"started",
    "cached_tokens"} when the job reaches the model, {"text", "tokens"} per step, then
    {"done": finish_reason, "stats", "prompt_tokens", "cached_tokens", "max_tokens"} or
    {"error": message, "status"}: 503 for a generation cancelled by the shutdown or ended by
    an allocation failure, 500 for a failure). `/health` reads `cache_figures`,
    `batch_figures` and `memory_figures`, which the worker publishes (after every job, after
    every step): the prompt cache and the engine are only ever touched by the worker.

    memory: the `MemoryBudget` admissions keep to (None: none, rows alone bound them).
    """

    def __init__(self, pipe: Pipeline, *, queue_size: int = 16,
                 block_size: int | str | None = None, prompt_cache=None,
                 max_batch: int = check.MAX_BATCH, prefill_chunk: int = check.PREFILL_CHUNK,
                 memory: MemoryBudget | None = None):
        self.pipe = pipe
        self.block_size = block_size
        self.prompt_cache = prompt_cache
        self.max_batch = check.max_batch(max_batch)
        self.prefill_chunk = check.prefill_chunk(prefill_chunk)
        self.queue_size = queue_size
        # unbounded: `submit` bounds it, counting the rows free now as places too
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._running = False
        self.busy = False
        self._jobs: list[Job] = []   # running (admitted) jobs, guarded by _closing
        self.served = 0
        self.cancelled = 0           # generations ended early because the client left
        self._closing = threading.Lock()
        self._closed = False
        self.cache_figures: dict | None = None
        self.memory = memory
        self.fit = memory.most_tokens() if memory is not None else None   # tokens alone
        self._held: Job | None = None     # the queue's head, waiting for memory (_closing)
        self._carried: dict[int, int] = {}    # id(job) -> tokens generated before a rebuild
        self.memory_figures: dict | None = None
        self._peak_before = 0        # MLX's peak before the last reset (`_step` resets it)
        self._step_rise = 0          # the most a decoding step raised MLX's memory above its start
        self.states_not_kept = 0     # finished sequences' states not kept for want of memory
        self._engine: Engine | None = None     # the worker's (`_serve`)
        self.why = Engine.solo_reason(pipe.adapter, self.max_batch)
        self.mode = BATCH if self.why is None else SINGLE
        self.rows = self.max_batch if self.why is None else 1     # requests decoding at once
        log.info(f"scheduler: continuous batching, up to {self.max_batch} sequences, "
                 f"{self.prefill_chunk} prompt tokens prefilled per step"
                 if self.mode == BATCH else f"scheduler: one request at a time ({self.why})")
        self.batch_figures: dict = self._figures(0, 0, [])
        self._publish_memory()

    def start(self) -> None:
        """Run the worker on a thread of its own (an app served by another ASGI runner).
        `serve` runs it on the main thread instead: with MLX 0.32 (CPU) a process whose MLX
        work ran on another thread sometimes aborts at exit (std::terminate)."""
        self._thread = threading.Thread(target=self.work, name="dflash2-generate", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel the running jobs at their next step (each ends with a 503 error event) and end
        the worker; queued jobs get the 503 now, later submissions `ShuttingDown`. Safe to
        call again, from any thread."""
        with self._closing:
            self._closed = True
            for job in self._jobs:
                job.cancel("shutdown")
            while True:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job.emit({"error": SHUTDOWN, "status": 503})
            if self._held is not None:
                self._held.emit({"error": SHUTDOWN, "status": 503})
                self._held = None
            # drained (an earlier call's sentinel too, if the worker has not read it yet: one
            # goes back), and nothing is added once closed
            self._queue.put(None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> Job:
        """Queue a request -> its job. Raises QueueFull, ShuttingDown, or NeverFits (its
        caches exceed the memory budget even alone)."""
        if self.memory is not None and self.fit < request_length(request):
            raise NeverFits(self.memory.too_long(request_length(request)))
        job = Job(request, loop)
        with self._closing:
            if self._closed:
                raise ShuttingDown
            # a request that a free row takes at the next step is not waiting: two arriving
            # at once on an idle server with queue_size 1 are both served, whichever the
            # worker picks up first
            if self.waiting >= self.queue_size + max(0, self.rows - len(self._jobs)):
                raise QueueFull
            self._queue.put_nowait(job)
        return job

    @property
    def waiting(self) -> int:
        return self._queue.qsize() + (self._held is not None)

    @property
    def alive(self) -> bool:
        return self._running

    def work(self) -> None:
        """Run jobs until `stop`; on whichever thread calls it. MLX's peak memory counts from
        here (/health's memory "peak"; loading may peak higher, converting weights)."""
        mx.reset_peak_memory()
        self._running = True
        self._publish()
        try:
            self._serve()
        finally:
            self._running = False
            if self.prompt_cache is not None:
                self.prompt_cache.close()       # the disk tier writes what is queued

    # ---- bookkeeping
    def _register(self, job: Job) -> None:
        with self._closing:
            self._jobs.append(job)
            if self._closed:             # taken from the queue as stop() drained it
                job.cancel("shutdown")
        self.busy = True

    def _done(self, job: Job) -> None:
        with self._closing:
            self._jobs.remove(job)
        self.served += 1
        self.cancelled += job.why == "client"
        self.busy = bool(self._jobs)
        self._publish()
        self._publish_memory(self._engine)      # its reservation gone before its client hears

    @staticmethod
    def _final(job: Job, finish: str, stats: dict) -> None:
        if job.why == "shutdown":
            # not a finish: the client gets an error (a 503, or its stream's error event)
            job.emit({"error": f"{SHUTDOWN}: the generation was cancelled", "status": 503})
            return
        job.emit({"done": finish, "stats": stats, "prompt_tokens": len(job.request.prompt),
                  "cached_tokens": stats.get("cached_tokens", 0),
                  "max_tokens": job.request.max_tokens})

    @staticmethod
    def _failed(job: Job, e: Exception) -> None:
        job.emit({"error": f"{type(e).__name__}: {e}", "status": 500})

    def _publish(self) -> None:
        """The prompt cache's figures for /health, read here on the worker's thread (another
        thread iterating the cache while the worker changes it could fail)."""
        c = self.prompt_cache
        self.cache_figures = None if c is None else {
            **c.stats.to_dict(), "entries": len(c), "bytes": c.nbytes,
            "disk": c.disk.describe() if c.disk else None}

    def _figures(self, running: int, prefilling: int, stats: list[GenerationStats],
                 last_step: tuple[int, int, float] | None = None) -> dict:
        """/health's "batch": the running sequences' sizes (never their text)."""
        return {"mode": self.mode, "why": self.why, "max_batch": self.max_batch,
                "prefill_chunk": self.prefill_chunk, "running": running,
                "prefilling": prefilling, "waiting": self.waiting,
                "sequences": [{"prompt_tokens": s.prompt_tokens,
                               "cached_tokens": s.cached_tokens,
                               "tokens": s.generated_tokens} for s in stats],
                "last_step": None if last_step is None else dict(zip(
                    ("sequences", "rows", "seconds"), last_step))}

    # ---- the loop (the worker's thread only)
    def _serve(self) -> None:
        pipe = self.pipe
        self._b, self._stop_ids = pipe.block_size(self.block_size), pipe.stop_ids()
        self._engine = self._new_engine()
        self._decoding: dict[int, tuple[Job, SequenceText]] = {}  # engine id -> job, text
        self._queue_closed = False
        # MLX's buffer cache is held within the budget while serving (`_mark_step`)
        self._cache_default = mx.set_cache_limit(0) if self.memory is not None else None
        try:
            while True:
                # before admitting: a request that left mid-prefill is in the prefix cache for
                # its retry (an agent that timed out sends the same prompt again at once)
                self._leave_cancelled()
                self._admit_queued()
                self._leave_cancelled()
                if self._decoding:
                    self._step()
                    continue
                self._publish_batch()
                if self._queue_closed:
                    return
        finally:
            if self._cache_default is not None:
                mx.set_cache_limit(self._cache_default)

    def _new_engine(self) -> Engine:
        """The engine for the next steps: an allocation failure in one sequence's prefill
        ends that sequence alone; a finished sequence's state is copied out for the prefix
        cache only where the budget has room for it (`_room_for_state`)."""
        engine = self.pipe.engine(self.max_batch)
        engine.isolate_oom = True
        if self.memory is not None:
            engine.room_for_state = self._room_for_state
        return engine

    def _emit(self, ev) -> None:
        """A step's tokens to their job (a first token as soon as it is sampled)."""
        job, text = self._decoding[ev.id]
        job.emit({"text": text(ev.tokens, ev.finish), "tokens": list(ev.tokens)})

    def _publish_batch(self, last=None) -> None:
        """/health's view of the batch and of memory."""
        engine = self._engine
        self.batch_figures = self._figures(
            engine.running, engine.waiting, [engine.stats[rid] for rid in self._decoding], last)
        self._publish_memory(engine)

    def _admit_queued(self) -> None:
        """Queued jobs join, in order, while rows are free (waiting for one when nothing
        runs) and the next one's caches fit in the memory budget (else it waits, held)."""
        while not self._queue_closed and len(self._decoding) < self.rows:
            with self._closing:
                job, self._held = self._held, None
            if job is None:
                try:
                    job = self._queue.get(block=not self._decoding)
                except queue.Empty:
                    break
                if job is None:
                    self._queue_closed = True
                    break
            if job.cancelled.is_set():        # its client left while it waited
                self.cancelled += 1
                continue
            room = self._room_for(job)
            if room == WAIT:
                with self._closing:
                    if self._closed:
                        job.emit({"error": SHUTDOWN, "status": 503})
                    else:
                        self._held = job
                break
            if room == ADMIT:
                self._admit(job)
            else:                 # alone and with the prefix cache empty: it cannot fit
                job.emit({"error": f"out of memory: {room}", "status": 400})
                self.served += 1

    def _leave_cancelled(self) -> None:
        gone = []
        for rid, (job, _) in list(self._decoding.items()):
            if self._queue_closed:
                job.cancel("shutdown")
            if job.cancelled.is_set():
                self._engine.cancel(rid)              # its rows are freed now
                gone.append((rid, self._decoding.pop(rid)[0]))
        if gone:         # /health shows the batch without them before `busy` reads False
            self._publish_batch()
        for rid, job in gone:
            self._leave(rid, job, "cancelled")

    def _step(self) -> None:
        """One engine step. A sequence whose prefill fails to allocate ends alone (the
        engine's FAILED event); a step that fails to allocate otherwise ends the newest
        running sequence and rebuilds the others (`_rebuild`); any other failure ends every
        running job with an error and starts a new engine for the next."""
        self._make_room()
        engine = self._engine
        budget = self.prefill_budget(engine.running, engine.waiting,
                                     self.pipe.prefill_step_size, engine.last_prefill)
        budget = self._peak_bound(budget)
        start, decoding_only = self._mark_step(), not engine.queue
        try:
            events = engine.step(prefill_budget=budget, started=self._emit)
            self._note_peak(f"in a step of {len(engine.rows)} rows, {len(engine.queue)} "
                            f"prefilling (at most {budget} prompt tokens), "
                            f"{sum(ev.finish is not None for ev in events)} leaving", start)
            if decoding_only and all(ev.finish is None for ev in events):
                # a decoding step's transients alone (a leave's copy asks `_room_for_state`)
                self._step_rise = max(self._step_rise, mx.get_peak_memory() - start)
        except Exception as e:  # noqa: BLE001 - reported to the batch; the next one runs
            if mem.out_of_memory(e):
                self._rebuild(engine, e)
                return
            log.exception("generation failed")
            jobs = [job for job, _ in self._decoding.values()]
            self._decoding.clear()
            for job in jobs:
                self._done(job)                 # counted before its client hears
                self._failed(job, e)
            self._engine = self._new_engine()
            return
        for ev in events:
            if ev.finish == FAILED:
                job = self._decoding.pop(ev.id)[0]
                engine.stats.pop(ev.id, None)
                self._out_of_memory(job, engine.failures.pop(ev.id))
                continue
            self._emit(ev)
            if ev.finish is not None:
                self._leave(ev.id, self._decoding.pop(ev.id)[0], ev.finish)
        last = engine.history[-1] if engine.history else None
        engine.history.clear()        # a server's engine runs for good: keep the last
        self._publish_batch(last)

    def _rebuild(self, old: Engine, e: BaseException) -> None:
        """A step failed to allocate where the batch's caches may be half-written: the newest
        running sequence ends (`_out_of_memory`); the others continue on a new engine from
        their tokens so far (prompt + generated, prefilled again; greedy output continues as
        a greedy decoding of the same tokens), the jobs not yet started from scratch."""
        seqs = {seq.id: seq for seq in list(old.rows) + list(old.queue)}
        order = {id(job): i for i, job in enumerate(self._jobs)}
        started = [rid for rid in self._decoding if rid in seqs and seqs[rid].tokens]
        victim = max(started or self._decoding,
                     key=lambda rid: order.get(id(self._decoding[rid][0]), -1))
        decoding, self._decoding = self._decoding, {}
        self._engine = engine = self._new_engine()
        for rid, (job, text) in decoding.items():
            seq = seqs.get(rid)
            if rid == victim or seq is None:       # (None: it ended in the failed step)
                self._out_of_memory(job, e)
                continue
            r = job.request
            done = self._carried.get(id(job), 0) + len(seq.tokens)
            state, cached = None, 0
            if not seq.tokens and self.prompt_cache is not None:
                state, cached = self.prompt_cache.fetch(r.prompt)
            ids = list(seq.req.prompt) + seq.tokens
            media = None if r.media is None else r.media.extended(seq.tokens)
            new = engine.add(self.pipe.request(
                engine, ids, r.max_tokens - done, r.sampling, self._b, lookup=self.pipe.lookup,
                stop_ids=self._stop_ids, seed=r.seed, state=state,
                keep_state=self.prompt_cache is not None, media=media))
            self._carried[id(job)] = done
            self._decoding[new] = (job, text)
        log.warning(f"out of memory in a step: {len(self._decoding)} sequences go on, "
                    "prefilled again from their tokens")
        self._publish_batch()

    def _admit(self, job: Job) -> None:
        """Start a job's sequence, from the prefix cache's state when it has one."""
        r, pipe, engine = job.request, self.pipe, self._engine
        self._register(job)
        try:
            state, cached = None, 0
            if self.prompt_cache is not None:
                state, cached = self.prompt_cache.fetch(r.prompt)
            job.emit({"started": True, "cached_tokens": cached})
            rid = engine.add(pipe.request(engine, r.prompt, r.max_tokens, r.sampling, self._b,
                                          lookup=pipe.lookup, stop_ids=self._stop_ids,
                                          seed=r.seed, state=state,
                                          keep_state=self.prompt_cache is not None,
                                          checkpoint=r.checkpoint, media=r.media))
        except Exception as e:  # noqa: BLE001 - reported to that request; the others run
            log.exception("generation failed")
            self._done(job)                 # counted before its client hears
            self._failed(job, e)
            return
        self._decoding[rid] = (job, SequenceText(pipe.tokenizer, self._stop_ids))

    def _leave(self, rid: int, job: Job, finish: str) -> None:
        """A sequence left (finished or cancelled): its state to the prefix cache, its final
        event to its job."""
        engine = self._engine
        stats = engine.stats.pop(rid).to_dict()
        stats["generated_tokens"] = stats.get("generated_tokens", 0) + \
            self._carried.pop(id(job), 0)
        state, kept = engine.pop_state(rid), engine.pop_checkpoint(rid)
        if kept is not None and self.prompt_cache is not None:
            # where the next turn's prompt parts from this one's output (its reasoning
            # dropped), for a state that cannot be trimmed back there
            self.prompt_cache.insert(kept)
        if state is not None and self.prompt_cache is not None:
            # it covers the prompt and the answer (but its last token): the next turn of
            # this conversation starts from it
            self.prompt_cache.insert(state)
        if self.prompt_cache is not None and (state is not None or kept is not None):
            self._make_room()
        self._done(job)             # counted (/health's served) before its client hears
        self._final(job, finish, stats)

