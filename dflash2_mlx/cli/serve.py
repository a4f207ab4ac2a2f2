"""`dflash2-mlx serve`: load, then serve the OpenAI- and Anthropic-compatible HTTP APIs of
`dflash2_mlx.server` (needs the `serve` extra) until Ctrl-C / SIGTERM."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import typer

from .. import log
from .. import settings as check
from .common import (BLOCK_SIZE, DRAFT, DRAFT_BITS, DRAFT_GROUP_SIZE, DTYPE, KERNELS, KV_BITS,
                     KV_GROUP_SIZE, LOOKUP, MODEL, MODEL_ID, OMLX_SETTINGS, PIPELINE_SPLIT,
                     PIPELINE_TIMEOUT, app, errors, flag, load_pipeline, pipeline_group)

_log = log.get(__name__)

HOST = typer.Option("127.0.0.1", "--host", help="Address to listen on")
PORT = typer.Option(8080, "--port", callback=flag(check.port), help="Port; 0 = any free one")
API_KEY = typer.Option(
    None, "--api-key", envvar="DFLASH2_API_KEY", help="Require this key (Authorization: "
    "Bearer KEY or x-api-key: KEY); also read from $DFLASH2_API_KEY")
MAX_TOKENS = typer.Option(4096, "--max-tokens", callback=flag(check.max_tokens),
                          help="Most tokens one request may generate")
CONTEXT_LENGTH = typer.Option(
    None, "--context-length", callback=flag(check.context_length),
    help="Prompt + completion tokens (default: the target's max_position_embeddings)")
BEYOND_POSITIONS = typer.Option(
    False, "--allow-context-beyond-model", help="Accept a --context-length above the "
    "positions the target was trained for (its output past them is unreliable)")
KEEP_BILLING_HEADER = typer.Option(
    False, "--keep-billing-header", help="Keep Claude Code's per-session "
    "`x-anthropic-billing-header` system block in the prompt (by default it is left out, "
    "so that a new session reuses the prefix cache)")
CHAT_TEMPLATE_ARGS = typer.Option(
    None, "--chat-template-args", metavar="JSON", callback=flag(check.chat_template_args),
    help="Arguments for the chat template, as mlx-lm takes them, e.g. "
    "'{\"enable_thinking\": false}'; a request's own switches go over them")
MAX_BODY_BYTES = typer.Option(64 * 2**20, "--max-body-bytes",
                              callback=flag(check.max_body_bytes),
                              help="Largest request body (images come as base64)")
MAX_IMAGES = typer.Option(check.MAX_IMAGES, "--max-images", callback=flag(check.max_images),
                          help="Images one request may carry (a vision-language target)")
MAX_IMAGE_BYTES = typer.Option(str(check.MAX_IMAGE_BYTES), "--max-image-bytes", metavar="N",
                               callback=flag(check.max_image_bytes),
                               help="Largest encoded image, e.g. 20MiB")
MAX_IMAGE_PIXELS = typer.Option(check.MAX_IMAGE_PIXELS, "--max-image-pixels",
                                callback=flag(check.max_image_pixels),
                                help="Most pixels (width x height) an image may decode to")
FETCH_IMAGES = typer.Option(False, "--fetch-images", help="Fetch image parts given as http(s) "
                            "URLs (by default only inline base64 / data: URLs are taken)")
QUEUE_SIZE = typer.Option(16, "--queue-size", callback=flag(check.queue_size),
                          help="Requests that may wait for a free row; more get 429")
PROMPT_CACHE_SIZE = typer.Option(8, "--prompt-cache-size",
                                 callback=flag(check.prompt_cache_size),
                                 help="Prefix-cache entries in RAM; 0: none")
PROMPT_CACHE_BYTES = typer.Option(2 * 2**30, "--prompt-cache-bytes",
                                  callback=flag(check.prompt_cache_bytes),
                                  help="Most bytes the prefix cache holds")
PROMPT_CACHE_DIR = typer.Option(
    None, "--prompt-cache-dir", metavar="DIR", help="Also keep prefix-cache entries on "
    "disk in DIR: they outlive RAM and restarts (default: RAM only)")
PROMPT_CACHE_DISK_BYTES = typer.Option(
    None, "--prompt-cache-disk-bytes", metavar="N", callback=flag(check.byte_size),
    help="Most bytes the disk tier holds, e.g. 20GiB (default: 8 GiB)")
SHUTDOWN_TIMEOUT = typer.Option(
    5.0, "--shutdown-timeout", callback=flag(check.shutdown_timeout),
    help="Seconds in-flight requests get to finish on Ctrl-C / SIGTERM before they are "
    "cancelled")
MAX_BATCH = typer.Option(check.MAX_BATCH, "--max-batch", callback=flag(check.max_batch),
                         help="Requests generated at once (continuous batching); "
                         "1: one at a time")
PREFILL_CHUNK = typer.Option(
    check.PREFILL_CHUNK, "--prefill-chunk", metavar="TOKENS",
    callback=flag(check.prefill_chunk), help="Prompt tokens a joining request prefills "
    "per step while others decode")
MEMORY_BUDGET = typer.Option(
    None, "--memory-budget", metavar="SIZE|PCT", callback=flag(check.memory_budget),
    help="The most memory the server may take, weights included: bytes (24GiB, 12G) or a "
    "share of the device's memory (70%). A request joins when its KV cache, for its prompt "
    "and max tokens, fits; else it waits (default: the device's memory as MLX reports it, "
    "less a margin; `doctor --model M` says what fits)")
PING_INTERVAL = typer.Option(
    15.0, "--ping-interval", callback=flag(check.ping_interval),
    help="Seconds of silence before a stream sends a keep-alive ping")
READ_TIMEOUT = typer.Option(
    30.0, "--read-timeout", callback=flag(check.read_timeout),
    help="Seconds a client may take to send a request's head or the next part of its body")
PIPELINE = typer.Option(False, "--pipeline", help="Split the target's layers across the ranks "
                        "started by mlx.launch (rank 0 serves)")
VERBOSE = typer.Option(False, "--verbose", help="Debug logs, tracebacks")


@app.command()
def serve(
    model: Optional[str] = MODEL,
    draft: Optional[str] = DRAFT,
    host: str = HOST,
    port: int = PORT,
    block_size: Optional[str] = BLOCK_SIZE,
    lookup: bool = LOOKUP,
    draft_bits: Optional[str] = DRAFT_BITS,
    draft_group_size: Optional[str] = DRAFT_GROUP_SIZE,
    kv_bits: Optional[str] = KV_BITS,
    kv_group_size: Optional[str] = KV_GROUP_SIZE,
    dtype: Optional[str] = DTYPE,
    kernels: Optional[str] = KERNELS,
    omlx_settings: Optional[str] = OMLX_SETTINGS,
    model_id: Optional[str] = MODEL_ID,
    api_key: Optional[str] = API_KEY,
    max_tokens: int = MAX_TOKENS,
    context_length: Optional[int] = CONTEXT_LENGTH,
    beyond_positions: bool = BEYOND_POSITIONS,
    keep_billing_header: bool = KEEP_BILLING_HEADER,
    chat_template_args: Optional[str] = CHAT_TEMPLATE_ARGS,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_images: int = MAX_IMAGES,
    max_image_bytes: str = MAX_IMAGE_BYTES,
    max_image_pixels: int = MAX_IMAGE_PIXELS,
    fetch_images: bool = FETCH_IMAGES,
    queue_size: int = QUEUE_SIZE,
    prompt_cache_size: int = PROMPT_CACHE_SIZE,
    prompt_cache_bytes: int = PROMPT_CACHE_BYTES,
    prompt_cache_dir: Optional[Path] = PROMPT_CACHE_DIR,
    prompt_cache_disk_bytes: Optional[str] = PROMPT_CACHE_DISK_BYTES,
    shutdown_timeout: float = SHUTDOWN_TIMEOUT,
    max_batch: int = MAX_BATCH,
    prefill_chunk: int = PREFILL_CHUNK,
    memory_budget: Optional[str] = MEMORY_BUDGET,
    ping_interval: float = PING_INTERVAL,
    read_timeout: float = READ_TIMEOUT,
    pipeline: bool = PIPELINE,
    pipeline_split: Optional[str] = PIPELINE_SPLIT,
    pipeline_timeout: float = PIPELINE_TIMEOUT,
    verbose: bool = VERBOSE,
):
    """Serve OpenAI- and Anthropic-compatible HTTP APIs (needs the `serve` extra)."""
    with errors(verbose):
        group = pipeline_group(pipeline, pipeline_split, pipeline_timeout,
                               grace=shutdown_timeout + 5.0)
        if verbose:
            log.setup(logging.DEBUG, rank=group.rank() if group is not None else 0)
        server = _server(prompt_cache_dir, prompt_cache_disk_bytes)
        pipe = load_pipeline(model, draft, omlx_settings, model_id, block_size, lookup,
                             draft_bits=draft_bits, draft_group_size=draft_group_size,
                             kv_bits=kv_bits, kv_group_size=kv_group_size, dtype=dtype,
                             kernels=kernels, pipeline=group, pipeline_split=pipeline_split,
                             pipeline_timeout=pipeline_timeout)
        if pipe is None:                     # a rank > 0: it served rank 0 until it closed
            return
        config = server.ServerConfig(
            model_id=server.model_id_for(pipe.info["model"]), max_tokens=max_tokens,
            context_length=_context_length(pipe, context_length, beyond_positions),
            max_body_bytes=max_body_bytes, queue_size=queue_size, api_key=api_key,
            block_size=block_size, prompt_cache_size=prompt_cache_size,
            prompt_cache_bytes=prompt_cache_bytes,
            prompt_cache_dir=None if prompt_cache_dir is None else str(prompt_cache_dir),
            prompt_cache_disk_bytes=prompt_cache_disk_bytes or check.PROMPT_CACHE_DISK_BYTES,
            ping_interval=ping_interval, read_timeout=read_timeout, max_batch=max_batch,
            prefill_chunk=prefill_chunk, memory_budget=memory_budget,
            keep_billing_header=keep_billing_header, chat_template_args=chat_template_args or {},
            max_images=max_images, max_image_bytes=max_image_bytes,
            max_image_pixels=max_image_pixels, fetch_images=fetch_images)
        server.serve(pipe, config, host=host, port=port, shutdown_timeout=shutdown_timeout,
                     ready=lambda url: _log.info(f"serving {config.model_id} on {url}"))
        _log.info("stopped")


def _server(prompt_cache_dir: Path | None, prompt_cache_disk_bytes: str | None):
    """The server package (a clear error without the `serve` extra), and the disk tier's
    folder made ready: both before the model loads."""
    try:
        from .. import server
    except ImportError as e:
        if e.name not in ("fastapi", "uvicorn", "starlette", "pydantic"):
            raise
        raise ValueError(f"serve needs the serve extra ({e.name} is missing): pip install "
                         "'dflash2-mlx[serve]'") from None
    if prompt_cache_dir is not None:
        from ..cache.disk import prepare_folder

        prepare_folder(prompt_cache_dir)
    elif prompt_cache_disk_bytes is not None:
        raise ValueError("--prompt-cache-disk-bytes sizes the disk tier: add "
                         "--prompt-cache-dir DIR")
    return server


def _context_length(pipe, asked: int | None, beyond_positions: bool) -> int:
    """--context-length, checked against the positions the target was made for (its
    max_position_embeddings, the default; 4096 when it has none)."""
    positions = pipe.context_length
    if asked and positions and asked > positions and not beyond_positions:
        raise ValueError(f"--context-length {asked} is above the {positions} "
                         "positions the target was made for (max_position_embeddings): "
                         "give at most that, or add --allow-context-beyond-model")
    return asked or positions or 4096
