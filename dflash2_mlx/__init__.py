"""dflash2-mlx: exact speculative decoding with DFlash 2 block drafters on MLX."""

from .lazy import exports

__version__ = "0.1.0"

# Public names, imported on first use (PEP 562) so that `dflash2-mlx --help`, `doctor` and
# flag errors answer without importing MLX and mlx-lm (~2 s). Importing the package changes
# nothing in the process: `use_fast_blas()` (called by `load()` and the CLI) picks the BLAS.
_EXPORTS = {
    "load": "pair", "Pipeline": "pipeline", "Generation": "pipeline", "Chunk": "pipeline",
    "DFlashNotice": "log", "GenerationStats": "decode.stats",
    "DrafterArgs": "model.config", "CheckpointError": "model.config",
    "load_omlx_settings": "loading.omlx", "OmlxSettings": "loading.omlx",
    "OmlxSettingsError": "loading.omlx", "use_fast_blas": "loading.blas",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = exports(__name__, _EXPORTS, globals())
