"""The app: `create_app` builds the FastAPI app (routers, error handlers, body limit, the
scheduler's lifespan), `serve` runs it under uvicorn until SIGINT / SIGTERM."""

from __future__ import annotations

import asyncio
import threading
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse

from .. import log as logs
from ..model import memory
from ..cache.prompt import PromptCache
from ..decode.engine import Engine
from ..pipeline import Pipeline
from . import anthropic_routes, openai_routes, responses
from .config import ServerConfig
from .errors import add_handlers
from .http import BodyLimit, ServiceDep
from .budget import MemoryBudget
from .scheduler import Scheduler
from .service import Service

log = logs.get(__name__)
health_router = APIRouter()


@health_router.get("/health")
async def health(service: ServiceDep):
    scheduler, config = service.scheduler, service.config
    ok = scheduler.alive
    return JSONResponse({"status": "ok" if ok else "unavailable", "model": config.model_id,
                         "busy": scheduler.busy, "waiting": scheduler.waiting,
                         "served": scheduler.served, "cancelled": scheduler.cancelled,
                         "batch": {**scheduler.batch_figures, "waiting": scheduler.waiting},
                         "prompt_cache": scheduler.cache_figures,
                         "memory": scheduler.memory_figures}, 200 if ok else 503)


@health_router.api_route("/", methods=["GET", "HEAD"])
async def root(service: ServiceDep):
    """What a client probing the base URL gets (Claude Code sends HEAD / first)."""
    return {"status": "ok", "model": service.config.model_id}


def memory_budget(pipe: Pipeline, config: ServerConfig, batched: bool) -> MemoryBudget | None:
    """The scheduler's memory budget (`config.memory_budget`); a target whose cache cannot
    be sized from its config runs without one unless a budget was asked for."""
    try:
        budget = MemoryBudget(pipe, config.memory_budget, batched=batched)
    except (KeyError, TypeError, ValueError) as e:
        if config.memory_budget is not None or "memory-budget" in str(e):
            raise
        log.warning(f"no memory budget: {e}")
        return None
    fit = budget.most_tokens()
    given = "--memory-budget" if config.memory_budget is not None else \
        f"the device's memory less a margin; {budget.source}"
    log.info(f"memory budget {memory.gib(budget.limit)} ({given}): weights "
             f"{memory.gib(budget.weights)}, {budget.target.per_token / 1024:.1f} KiB of KV "
             f"cache a token, {fit} tokens fit beside them")
    if fit < config.context_length:
        log.warning(f"--context-length {config.context_length} is more than the {fit} tokens "
                    "that fit in the memory budget: longer requests are refused; give "
                    f"--context-length {fit}, --kv-bits 8 or 4, or a larger --memory-budget")
    return budget


def create_app(pipe: Pipeline, config: ServerConfig, *, worker_thread: bool = True) -> FastAPI:
    """The ASGI app (`app.state.scheduler` runs the generations). worker_thread: the scheduler's
    worker starts on its own thread with the app's lifespan; False: the caller runs
    `scheduler.work()` (as `serve` does, on the main thread). It stops with the lifespan."""
    disk = None
    if config.prompt_cache_dir is not None:
        from ..cache.disk import DiskCache

        disk = DiskCache(config.prompt_cache_dir, config.prompt_cache_disk_bytes,
                         target=pipe.adapter, drafter=pipe.drafter)
    prompt_cache = (PromptCache(config.prompt_cache_size, config.prompt_cache_bytes, disk)
                    if config.prompt_cache_size > 0 or disk is not None else None)
    batched = Engine.solo_reason(pipe.adapter, config.max_batch) is None
    scheduler = Scheduler(pipe, queue_size=config.queue_size, block_size=config.block_size,
                          prompt_cache=prompt_cache, max_batch=config.max_batch,
                          prefill_chunk=config.prefill_chunk,
                          memory=memory_budget(pipe, config, batched))
    service = Service(pipe, config, scheduler)

    @asynccontextmanager
    async def lifespan(_app):
        if worker_thread:
            scheduler.start()
        yield
        await asyncio.to_thread(scheduler.stop)

    app = FastAPI(title="dflash2-mlx", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.service, app.state.scheduler = service, scheduler
    add_handlers(app)
    app.add_middleware(BodyLimit, limit=config.max_body_bytes, timeout=config.read_timeout)
    for router in (health_router, openai_routes.router, anthropic_routes.router,
                   responses.router):
        app.include_router(router)
    return app


# --------------------------------------------------------------------------- running it

def http_server(app: FastAPI, config: ServerConfig, *, host: str, port: int,
                shutdown_timeout: float, ready: Callable[[str], object] | None = None):
    """The uvicorn server `serve` runs: h11 with a deadline on each request's head (uvicorn
    has none: a connection that sends nothing would stay open) and, as the last resort behind
    the scheduler's own deadline, a graceful-shutdown timeout a few seconds past it."""
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        """Closes a connection whose request head is not complete `read_timeout` seconds after
        it opened or after its last response (the body has `BodyLimit`'s deadline)."""

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm(None)

        def on_response_complete(self):
            done = self.cycle
            super().on_response_complete()
            self._arm(done)

        def _arm(self, done):
            """The next head must be in within read_timeout: a cycle other than `done`."""
            def expire():
                if self.cycle is done and not self.transport.is_closing():
                    self.transport.close()
            asyncio.get_running_loop().call_later(config.read_timeout, expire)

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started and ready is not None:
                bound = [s.getsockname() for srv in self.servers for s in srv.sockets]
                where = bound[0] if bound else (host, port)
                ready(f"http://{_host_for_url(where[0])}:{where[1]}")

    return Server(uvicorn.Config(
        app, host=host, port=port, http=Protocol, log_level="warning", access_log=False,
        timeout_graceful_shutdown=shutdown_timeout + 5.0, lifespan="on"))


def serve(pipe: Pipeline, config: ServerConfig, *, host: str = "127.0.0.1", port: int = 8080,
          shutdown_timeout: float = 5.0,
          ready: Callable[[str], object] | None = None) -> None:
    """Serve until SIGINT / SIGTERM, then return (exit status 0). In-flight requests get
    `shutdown_timeout` seconds (fractions honoured) to finish; then the running generation is
    cancelled at its next cycle and answered with a 503 (a stream: its error event, then its
    end), as are the requests still queued. A second Ctrl-C stops waiting.

    The generations run on the calling (main) thread, HTTP on a uvicorn thread: MLX stays on
    one thread, and the signals reach the main thread, where Python delivers them."""
    import signal

    app = create_app(pipe, config, worker_thread=False)
    scheduler: Scheduler = app.state.scheduler
    server = http_server(app, config, host=host, port=port, shutdown_timeout=shutdown_timeout,
                         ready=ready)
    # the deadline is the scheduler's, not uvicorn's: cancelled here, every response ends in its
    # own shape before uvicorn would cut it
    deadline = threading.Timer(shutdown_timeout, scheduler.stop)
    deadline.daemon = True

    def on_signal(sig, _frame):
        if server.should_exit and sig == signal.SIGINT:
            server.force_exit = True            # a second Ctrl-C: stop waiting
            scheduler.stop()
        elif not server.should_exit:
            deadline.start()
        server.should_exit = True

    def http() -> None:
        try:
            server.run()            # off the main thread, uvicorn installs no signal handlers
        finally:
            scheduler.stop()        # also when it could not start (e.g. the port is taken)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=http, name="dflash2-http")
    thread.start()
    try:
        scheduler.work()
    finally:
        server.should_exit = True
        thread.join()
        deadline.cancel()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        raise OSError(f"could not listen on {host}:{port} (see the message above)")


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host
