"""`python -m dflash2_mlx.cli ...`: the `dflash2-mlx` command."""

from .entry import main

main()
