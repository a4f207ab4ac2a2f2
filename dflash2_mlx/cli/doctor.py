"""`dflash2-mlx doctor` and `dflash2-mlx calibrate`: print what `dflash2_mlx.doctor` reports,
time the cost calibrations again."""

from __future__ import annotations

from typing import Optional

import typer

from .. import log
from .common import app, errors

_log = log.get(__name__)


@app.command()
def doctor(
    model: Optional[str] = typer.Option(
        None, "--model", help="Also report on this target (a folder, a .gguf file or a hub id; "
        "only its config is read): its shape, the drafter a run with it would take, KV cache "
        "bytes per token in float, 8-bit and 4-bit, and the tokens of context that fit beside "
        "its weights on this machine"),
    verbose: bool = typer.Option(False, "--verbose", help="Tracebacks"),
):
    """MLX version and backend, the BLAS in effect, kernels, precision defaults, caches; with
    --model, that target's drafter and what fits."""
    with errors(verbose):
        from ..doctor import memory_rows, report

        for name, value in report(model):
            print(f"{name:<14}{value}", flush=True)
        if model is not None:
            print(f"\nmemory for {model}:")
            for line in memory_rows(model):
                print(f"  {line}")


@app.command()
def calibrate(
    model: Optional[str] = typer.Option(None, "--model", help="Target, as `generate` takes it "
                                        "(default: every stored pair)"),
    draft: Optional[str] = typer.Option(None, "--draft", "--draft-model",
                                        help="Drafter, as `generate` takes it"),
    verbose: bool = typer.Option(False, "--verbose", help="Tracebacks"),
):
    """Time the draft and verify costs that `auto` prices its choices by again: of the pair
    given, or of every stored pair (`doctor` lists them)."""
    with errors(verbose):
        from ..doctor import calibration_rows, recalibrate

        recalibrate(model, draft)
        for line in calibration_rows():
            _log.info(line)
