"""`dflash2-mlx generate`: load, stream the text to stdout, one summary line to stderr."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from .. import log
from .. import settings as check
from ..files import atomic_write
from .common import (BLOCK_SIZE, DRAFT, DRAFT_BITS, DRAFT_GROUP_SIZE, DTYPE, KERNELS, KV_BITS,
                     KV_GROUP_SIZE, LOOKUP, MODEL, MODEL_ID, OMLX_SETTINGS, PIPELINE_SPLIT,
                     PIPELINE_TIMEOUT, app, errors, flag, load_pipeline, pipeline_group, prompt_flag,
                     read_stdin, summary, writable)

_log = log.get(__name__)

PROMPT = typer.Option("hello", "--prompt", "-p", callback=prompt_flag,
                      help="Prompt text; '-' reads stdin")
IMAGE = typer.Option(None, "--image", metavar="PATH",
                     help="An image shown before the prompt (repeatable; a vision-language "
                     "model)")
SYSTEM = typer.Option(None, "--system", "--system-prompt",
                      help="System message (with a chat template)")
MAX_TOKENS = typer.Option(256, "--max-tokens", "-m", callback=flag(check.max_tokens),
                          help="Most tokens to generate")
TEMP = typer.Option(0.0, "--temp", callback=flag(check.temperature),
                    help="Temperature; 0 = greedy")
TOP_P = typer.Option(1.0, "--top-p", callback=flag(check.top_p), help="Nucleus mass in (0, 1]")
TOP_K = typer.Option(0, "--top-k", callback=flag(check.top_k),
                     help="Keep the k likeliest; 0 = all")
SEED = typer.Option(None, "--seed", callback=flag(check.seed),
                    help="Random seed for sampling, 0..2**64-1")
NO_CHAT_TEMPLATE = typer.Option(False, "--no-chat-template", "--ignore-chat-template",
                                help="Use the prompt as raw text")
STATS_JSON = typer.Option(None, "--stats-json", metavar="PATH",
                          help="Write statistics and effective settings")
PIPELINE = typer.Option(False, "--pipeline", help="Split the target's layers across the ranks "
                        "started by mlx.launch (rank 0 writes the output)")
VERBOSE = typer.Option(False, "--verbose", help="Effective settings, tracebacks")


@app.command()
def generate(
    model: Optional[str] = MODEL,
    draft: Optional[str] = DRAFT,
    prompt: str = PROMPT,
    image: Optional[list[Path]] = IMAGE,
    system: Optional[str] = SYSTEM,
    max_tokens: int = MAX_TOKENS,
    temp: float = TEMP,
    top_p: float = TOP_P,
    top_k: int = TOP_K,
    seed: Optional[int] = SEED,
    block_size: Optional[str] = BLOCK_SIZE,
    lookup: bool = LOOKUP,
    draft_bits: Optional[str] = DRAFT_BITS,
    draft_group_size: Optional[str] = DRAFT_GROUP_SIZE,
    kv_bits: Optional[str] = KV_BITS,
    kv_group_size: Optional[str] = KV_GROUP_SIZE,
    dtype: Optional[str] = DTYPE,
    kernels: Optional[str] = KERNELS,
    no_chat_template: bool = NO_CHAT_TEMPLATE,
    omlx_settings: Optional[str] = OMLX_SETTINGS,
    model_id: Optional[str] = MODEL_ID,
    stats_json: Optional[Path] = STATS_JSON,
    pipeline: bool = PIPELINE,
    pipeline_split: Optional[str] = PIPELINE_SPLIT,
    pipeline_timeout: float = PIPELINE_TIMEOUT,
    verbose: bool = VERBOSE,
):
    """Generate text; it streams to stdout, one summary line goes to stderr."""
    with errors(verbose):
        if stats_json is not None:
            writable(stats_json, "--stats-json")
        for path in image or ():
            if not path.is_file():
                raise typer.BadParameter(f"no such file: {path}", param_hint="'--image'")
        group = pipeline_group(pipeline, pipeline_split, pipeline_timeout)
        text = read_stdin() if prompt == "-" else prompt
        pipe = load_pipeline(model, draft, omlx_settings, model_id, block_size, lookup,
                             draft_bits=draft_bits, draft_group_size=draft_group_size,
                             kv_bits=kv_bits, kv_group_size=kv_group_size, dtype=dtype,
                             kernels=kernels, pipeline=group, pipeline_split=pipeline_split,
                             pipeline_timeout=pipeline_timeout)
        if pipe is None:                     # a follower rank: it served rank 0 and is done
            return
        if verbose:
            _log.info("settings " + json.dumps(pipe.describe()))

        chunk = None
        for chunk in pipe.stream(text, max_tokens=max_tokens, temperature=temp, top_p=top_p,
                                 top_k=top_k, seed=seed, block_size=block_size,
                                 lookup=lookup, chat_template=False if no_chat_template else None,
                                 system=system, images=image or ()):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        _log.info(summary(chunk.stats))
        if stats_json is not None:
            _write_stats(stats_json, chunk, pipe.describe(), lookup)


def _write_stats(path: Path, chunk, settings: dict, lookup: bool) -> None:
    """--stats-json: the statistics, the finish reason and the effective settings."""
    report = {**chunk.stats.to_dict(), "finish_reason": chunk.finish_reason,
              "settings": {**settings, "block_size": chunk.stats.block_size, "lookup": lookup}}
    with atomic_write(path) as f:
        f.write(json.dumps(report, indent=2) + "\n")
