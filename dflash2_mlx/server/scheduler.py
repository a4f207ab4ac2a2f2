"""The generation queue: `Scheduler` owns the model and runs one `Job` at a time on its worker
thread; the HTTP side only submits jobs and reads their events."""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass, field

from .. import log as logs
from ..engine import DecodeState
from ..pipeline import Pipeline
from ..sampling import Sampling

log = logs.get(__name__)


@dataclass
class GenerationRequest:
    """What the model runs: prompt ids and sampling; stop strings and tools stay in HTTP."""

    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    seed: int | None = None


@dataclass
class Job:
    """One request's place in the queue and its channel back to the HTTP handler."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    why: str | None = None       # "client" (it left), "stop" (a stop string), "done", "shutdown"

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


SHUTDOWN = "the server is shutting down"


class Scheduler:
    """Requests wait in a bounded first-in first-out queue; one worker thread owns the model and
    runs them one at a time, so MLX never sees two generations at once.

    The HTTP layer only calls `submit` and reads `Job.events` (dicts: {"text", "tokens"} per
    cycle, then {"done": finish_reason, "stats", "prompt_tokens", "cached_tokens"} or
    {"error": message, "status"}: 503 for a generation cancelled by the shutdown, 500 for a
    failure); a batching scheduler can replace `_run` without touching the routes. `/health`
    reads `cache_figures`, which the worker publishes after every job: the prompt cache is only
    ever touched by the worker.
    """

    def __init__(self, pipe: Pipeline, *, queue_size: int = 16,
                 block_size: int | str | None = None, prompt_cache=None):
        self.pipe = pipe
        self.block_size = block_size
        self.prompt_cache = prompt_cache
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self._thread: threading.Thread | None = None
        self._running = False
        self.busy = False
        self._current: Job | None = None
        self.served = 0
        self.cancelled = 0           # generations ended early because the client left
        self._closing = threading.Lock()
        self._closed = False
        self.cache_figures: dict | None = None

    def start(self) -> None:
        """Run the worker on a thread of its own (an app served by another ASGI runner).
        `serve` runs it on the main thread instead: with MLX 0.32 (CPU) a process whose MLX
        work ran on another thread sometimes aborts at exit (std::terminate)."""
        self._thread = threading.Thread(target=self.work, name="dflash2-generate", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel the running job at its next cycle (it ends with a 503 error event) and end
        the worker; queued jobs get the 503 now, later submissions `ShuttingDown`. Safe to
        call again, from any thread."""
        with self._closing:
            first, self._closed = not self._closed, True
            if (job := self._current) is not None:
                job.cancel("shutdown")
            while True:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job.emit({"error": SHUTDOWN, "status": 503})
            if first:
                self._queue.put(None)        # drained, and nothing is added once closed
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> Job:
        job = Job(request, loop)
        with self._closing:
            if self._closed:
                raise ShuttingDown
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                raise QueueFull from None
        return job

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    @property
    def alive(self) -> bool:
        return self._running

    def work(self) -> None:
        """Run jobs until `stop`; on whichever thread calls it."""
        self._running = True
        self._publish()
        try:
            self._serve_jobs()
        finally:
            self._running = False
            if self.prompt_cache is not None:
                self.prompt_cache.close()       # the disk tier writes what is queued

    def _serve_jobs(self) -> None:
        while (job := self._queue.get()) is not None:
            if job.cancelled.is_set():        # its client left while it waited
                self.cancelled += 1
                continue
            self.busy, self._current = True, job
            try:
                self._run(job)
            except Exception as e:  # noqa: BLE001 - reported to that request; the next one runs
                log.exception("generation failed")
                job.emit({"error": f"{type(e).__name__}: {e}", "status": 500})
            finally:
                self.served += 1
                self.cancelled += job.why == "client"
                self._publish()
                self.busy, self._current = False, None

    def _publish(self) -> None:
        """The prompt cache's figures for /health, read here on the worker's thread (another
        thread iterating the cache while the worker changes it could fail)."""
        c = self.prompt_cache
        self.cache_figures = None if c is None else {
            **c.stats.to_dict(), "entries": len(c), "bytes": c.nbytes,
            "disk": c.disk.describe() if c.disk else None}

    def _run(self, job: Job) -> None:
        r = job.request
        s = r.sampling
        cache = self.prompt_cache
        state = None
        if cache is not None:
            state, _ = cache.fetch(r.prompt)
            if state is None:
                state = DecodeState.new(self.pipe.adapter, self.pipe.drafter)
        chunk = None
        steps = self.pipe.stream(r.prompt, max_tokens=r.max_tokens, temperature=s.temperature,
                                 top_p=s.top_p, top_k=s.top_k, seed=r.seed,
                                 block_size=self.block_size, state=state)
        try:
            for chunk in steps:
                job.emit({"text": chunk.text, "tokens": list(chunk.tokens)})
                if job.cancelled.is_set():
                    break
        finally:
            steps.close()          # a cancelled generation frees the model here
        if cache is not None:
            # the state now covers the prompt and the answer (but its last token): the next
            # turn of this conversation starts from it. An exception above skips this.
            cache.insert(state)
        if job.why == "shutdown":
            # not a finish: the client gets an error (a 503, or its stream's error event)
            job.emit({"error": f"{SHUTDOWN}: the generation was cancelled", "status": 503})
            return
        stats = chunk.stats.to_dict() if chunk is not None else {}
        finish = (chunk.finish_reason if chunk is not None else None) or "cancelled"
        job.emit({"done": finish, "stats": stats, "prompt_tokens": len(r.prompt),
                  "cached_tokens": stats.get("cached_tokens", 0)})

