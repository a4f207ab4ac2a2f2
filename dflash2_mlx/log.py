"""One logging system for the package: `logging` under the "dflash2_mlx" logger, a rank
filter for pipeline-sharded runs, and one progress helper (tqdm) for long work.

A library does not configure logging: `setup()` is called by the CLI (and may be called by an
app) to print the package's records as `dflash2-mlx: message` lines on stderr. Without it, the
records go wherever the embedding app's logging sends them.
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Iterable, Iterator, TypeVar

PROG = "dflash2-mlx"
ROOT = "dflash2_mlx"
T = TypeVar("T")


def get(name: str) -> logging.Logger:
    """The package logger for module `name` (`__name__`): a child of "dflash2_mlx"."""
    return logging.getLogger(name if name.startswith(ROOT) else f"{ROOT}.{name}")


class RankFilter(logging.Filter):
    """On the ranks > 0 of a pipeline only errors pass, tagged "(rank r)": rank 0 reports."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        if self.rank == 0:
            return True
        if record.levelno < logging.ERROR:
            return False
        record.rank_tag = f" (rank {self.rank})"
        return True


class _LineFormatter(logging.Formatter):
    """`dflash2-mlx: line`; warnings as `note: line`, errors as `error: line`."""

    def format(self, record: logging.LogRecord) -> str:
        tag = getattr(record, "rank_tag", "")
        message = record.getMessage()
        if record.exc_info:           # log.exception: the traceback follows the line
            message += "\n" + self.formatException(record.exc_info)
        if record.levelno >= logging.ERROR:
            return f"{PROG}: error{tag}: {message}"
        if record.levelno >= logging.WARNING:
            return f"{PROG}: note: {message}"
        return f"{PROG}: {message}"


_HANDLER: logging.Handler | None = None


def setup(level: int = logging.INFO, rank: int = 0) -> logging.Logger:
    """Print the package's records on stderr, one line each (idempotent; a later call changes
    the level and the rank, and writes to the `sys.stderr` of that moment)."""
    global _HANDLER
    logger = logging.getLogger(ROOT)
    if _HANDLER is None:
        _HANDLER = logging.StreamHandler(sys.stderr)
        _HANDLER.setFormatter(_LineFormatter())
        logger.addHandler(_HANDLER)
        logger.propagate = False
    _HANDLER.setStream(sys.stderr)
    for f in list(_HANDLER.filters):
        _HANDLER.removeFilter(f)
    _HANDLER.addFilter(RankFilter(rank))
    logger.setLevel(level)
    return logger


def teardown() -> None:
    """Undo `setup()`: the package's records go where the app's logging sends them again (the
    CLI's `main()` leaves a program that calls it as it found it)."""
    global _HANDLER
    logger = logging.getLogger(ROOT)
    if _HANDLER is not None:
        logger.removeHandler(_HANDLER)
        _HANDLER = None
    logger.propagate = True
    logger.setLevel(logging.NOTSET)


def progress(items: Iterable[T] | None, desc: str, total: int | None = None, unit: str = "it",
             **kw) -> Iterator[T]:
    """`items` with a progress bar on stderr (tqdm), shown only when stderr is a terminal and
    the package logs at INFO or below (the CLI's default; quiet in embedding apps that did not
    ask for it, and in log files, where a bar's carriage returns would pile up).
    items=None: a bar moved by hand (`.update(n)`, `.n` so far, `.close()`) to `total`."""
    from tqdm import tqdm

    return tqdm(items, desc=desc, total=total, unit=unit, mininterval=2.0, dynamic_ncols=True,
                file=sys.stderr, disable=not progress_shown(), leave=False, **kw)


def progress_shown() -> bool:
    """Whether progress bars show now: stderr is a terminal and the package logs at INFO."""
    return logging.getLogger(ROOT).isEnabledFor(logging.INFO) and _is_terminal(sys.stderr)


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):       # a replaced or closed stream
        return False


class DFlashNotice(UserWarning):
    """Something the user should know about how a generation runs (a fallback, an override)."""


def notice(message: str) -> None:
    warnings.warn(message, DFlashNotice, stacklevel=3)
