"""The server load test: `python -m dflash2_mlx.bench.serve_load` (see its --help)."""
from dflash2_mlx.bench.serve_load import main
main()
