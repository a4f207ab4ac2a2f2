"""dflash2-mlx: exact speculative decoding with DFlash 2 block drafters on MLX."""

from . import runtime as _runtime

_runtime.preload_openblas()  # must run before the first `import mlx`

from .config import CheckpointError, DrafterArgs  # noqa: E402
from .engine import GenerationStats  # noqa: E402
from .pipeline import Chunk, Generation, Pipeline, load  # noqa: E402

__version__ = "0.1.0"
__all__ = ["load", "Pipeline", "Generation", "Chunk", "GenerationStats", "DrafterArgs",
           "CheckpointError"]
