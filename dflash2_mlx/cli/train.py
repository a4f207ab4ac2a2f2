"""`dflash2-mlx train`: hands its arguments to `dflash2_mlx.train.command.train_command` when
the training package is installed."""

from __future__ import annotations

import typer

from .. import log
from .common import PROG, app, errors, run_app

_log = log.get(__name__)


@app.command("train", add_help_option=False,
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             help="Train a drafter (when the training package is installed; see train --help).")
def train(ctx: typer.Context):
    try:
        from ..train.command import train_command
    except ImportError as e:
        if e.name and not e.name.startswith("dflash2_mlx.train"):
            raise
        _log.error("`train` is not available in this version (dflash2_mlx.train is missing)")
        raise typer.Exit(1) from None
    sub = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    sub.command()(train_command)
    with errors("--verbose" in ctx.args):
        return run_app(sub, list(ctx.args), f"{PROG} train")
