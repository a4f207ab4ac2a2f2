"""The `dflash2-mlx` command: `generate`, `serve`, `doctor`, `calibrate`, `bench`, and `train`
when the training package is installed.

A thin layer over the Python API (`dflash2_mlx.load`, `Pipeline.stream`): parse flags, load,
stream, print. MLX and mlx-lm are imported inside the commands, so `--help`, flag errors and
oMLX settings errors answer before anything heavy loads. The package's log records print as
`dflash2-mlx: ...` lines on stderr (`log.setup`; ranks > 0 of a pipeline print only their
errors). Errors print one line (`dflash2-mlx: error: ...`) and exit non-zero; `--verbose` adds
the traceback. `main()` chooses the BLAS (`blas.use_fast_blas`) before MLX is imported.

One module a command (`generate`, `doctor` with `calibrate`, `bench`, `serve`, `train`), what
they share in `common`, the entry point in `entry`; `python -m dflash2_mlx.cli` runs `main()`.
"""

# the commands register on `app` as their modules load, in the order `--help` lists them
from . import generate, doctor, bench, serve, train  # noqa: F401
from .common import app
from .entry import main

__all__ = ["app", "main"]
