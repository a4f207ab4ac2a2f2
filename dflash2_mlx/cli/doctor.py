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
    model: Optional[str] = typer.Option(None, "--model", help="Also report on this target "
                                        "(folder or hub id; only its config.json is read): its "
                                        "shape and the drafter a run with it would take"),
    verbose: bool = typer.Option(False, "--verbose", help="Tracebacks"),
):
    """MLX version and backend, the BLAS in effect, kernels, precision defaults, caches; with
    --model, that target's drafter."""
    with errors(verbose):
        from ..doctor import report

        for name, value in report(model):
            print(f"{name:<14}{value}", flush=True)


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
