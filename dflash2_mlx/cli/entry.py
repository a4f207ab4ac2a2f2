"""The entry point, `main()`: the BLAS chosen before MLX loads, log lines and notices as
`dflash2-mlx: ...` while a command runs, the exit status."""

from __future__ import annotations

import logging
import sys
import warnings

from ..loading import blas
from .. import log
from .common import PROG, app, run_app

_log = log.get(__name__)
OPTIONAL_VALUE_FLAGS = {"--omlx-settings": ""}     # flag given without a value -> this value


def _notice_hook(previous):
    """A warnings.showwarning that logs DFlashNotice as one note line; others go to
    `previous`."""
    def show(message, category, *rest, **kw):
        if category.__name__ == "DFlashNotice":
            _log.warning(str(message))
        else:
            previous(message, category, *rest, **kw)
    return show


def _optional_values(args: list[str]) -> list[str]:
    """`--omlx-settings` may come without a value (typer has no optional-value options):
    give it an explicit empty one when the next word is another flag or there is none."""
    out = []
    for i, arg in enumerate(args):
        nxt = args[i + 1] if i + 1 < len(args) else None
        if arg in OPTIONAL_VALUE_FLAGS and (nxt is None or (nxt.startswith("-") and nxt != "-")):
            arg = f"{arg}={OPTIONAL_VALUE_FLAGS[arg]}"
        out.append(arg)
    return out


def main(argv: list[str] | None = None) -> None:
    args = _optional_values(list(sys.argv[1:] if argv is None else argv))
    if not args:               # click's no_args_is_help raises an error with an empty message
        args = ["--help"]
    # before the commands import MLX: then MLX binds to the chosen library as it loads
    blas.use_fast_blas()
    # log lines and notices print as "dflash2-mlx: ..." while the command runs; a program
    # calling main() gets its own logging and warning hook back afterwards
    log.setup(logging.INFO)
    previous = warnings.showwarning
    warnings.showwarning = _notice_hook(previous)
    try:
        code = run_app(app, args, PROG)
    finally:
        warnings.showwarning = previous
        log.teardown()
    sys.exit(code)
