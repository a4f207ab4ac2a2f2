"""The app: `create_app` builds the FastAPI app (routers, error handlers, body limit, the
scheduler's lifespan), `serve` runs it under uvicorn until SIGINT / SIGTERM."""

from __future__ import annotations

import asyncio
import threading
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse

from ..pipeline import Pipeline
from ..prompt_cache import PromptCache
from . import anthropic_routes, openai_routes, responses
from .config import ServerConfig
from .errors import add_handlers
from .http import BodyLimit, ServiceDep
from .scheduler import Scheduler
from .service import Service

health_router = APIRouter()


@health_router.get("/health")
async def health(service: ServiceDep):
    scheduler, config = service.scheduler, service.config
    ok = scheduler.alive
    cache = scheduler.prompt_cache
    return JSONResponse({"status": "ok" if ok else "unavailable", "model": config.model_id,
                         "busy": scheduler.busy, "waiting": scheduler.waiting,
                         "served": scheduler.served, "cancelled": scheduler.cancelled,
                         "prompt_cache": None if cache is None else {
                             **cache.stats.to_dict(), "entries": len(cache),
                             "bytes": cache.nbytes,
                             "disk": cache.disk.describe() if cache.disk else None}},
                        200 if ok else 503)


def create_app(pipe: Pipeline, config: ServerConfig, *, worker_thread: bool = True) -> FastAPI:
    """The ASGI app (`app.state.scheduler` runs the generations). worker_thread: the scheduler's
    worker starts on its own thread with the app's lifespan; False: the caller runs
    `scheduler.work()` (as `serve` does, on the main thread). It stops with the lifespan."""
    disk = None
    if config.prompt_cache_dir is not None:
        from ..disk_cache import DiskCache

        disk = DiskCache(config.prompt_cache_dir, config.prompt_cache_disk_bytes,
                         target=pipe.adapter, drafter=pipe.drafter)
    prompt_cache = (PromptCache(config.prompt_cache_size, config.prompt_cache_bytes, disk)
                    if config.prompt_cache_size > 0 or disk is not None else None)
    scheduler = Scheduler(pipe, queue_size=config.queue_size, block_size=config.block_size,
                          prompt_cache=prompt_cache)
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

def serve(pipe: Pipeline, config: ServerConfig, *, host: str = "127.0.0.1", port: int = 8080,
          shutdown_timeout: float = 5.0,
          ready: Callable[[str], object] | None = None) -> None:
    """Serve until SIGINT / SIGTERM, then return (exit status 0). In-flight requests get
    `shutdown_timeout` seconds to finish, then are cancelled at their next cycle.

    The generations run on the calling (main) thread, HTTP on a uvicorn thread: MLX stays on
    one thread, and the signals reach the main thread, where Python delivers them."""
    import signal

    import uvicorn

    app = create_app(pipe, config, worker_thread=False)
    scheduler: Scheduler = app.state.scheduler

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started and ready is not None:
                bound = [s.getsockname() for srv in self.servers for s in srv.sockets]
                where = bound[0] if bound else (host, port)
                ready(f"http://{_host_for_url(where[0])}:{where[1]}")

    server = Server(uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False,
        timeout_graceful_shutdown=max(1, int(round(shutdown_timeout))), lifespan="on"))

    def on_signal(sig, _frame):
        if server.should_exit and sig == signal.SIGINT:
            server.force_exit = True            # a second Ctrl-C: stop waiting
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
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        raise OSError(f"could not listen on {host}:{port} (see the message above)")


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host
