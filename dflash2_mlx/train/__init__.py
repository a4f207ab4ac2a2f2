"""Training DFlash / DFlash 2 drafters with MLX (the published DFlash recipe, scaled to a CPU).

Stages, each resumable from what it left on disk (`recipe.py` runs them in order):

  prompts    offline sources only (`prompts.py`): Python standard-library functions and
             docstrings, the documentation topics that ship with CPython, user turns sampled
             from the target's own chat template
  generate   the TARGET answers them (batched, greedy and sampled); the hidden states of the
             chosen layers and the target's top-k next-token distribution are captured during
             generation and stored on disk (fp16 features, uint16 ids) by `data.py`
  train      `trainer.py`: random response anchors per sequence, the context K/V of a sequence
             computed once, blocks see features before their anchor and their own rows only
             (`masks.py`, `packed.py`); weighted CE + distillation and the selector's candidate
             CE (`losses.py`); drafter layers initialised from the target (`init.py`)
  export     `export.py`: the published checkpoint layout (`config.json` + `model.safetensors`)
  evaluate   `evaluate.py`: offline tau / recall on HumanEval prompts by teacher forcing, and
             real generation through `dflash2_mlx.load`

Python entry point: `train_drafter(run="runs/x", steps=..., ...)` (the fields of
`config.Recipe` and of its parts, `DrafterShape` and `TrainConfig`, by name); command line:
`dflash2-mlx train` (`command.train_command`, its flags built from the same fields). Progress
and one line per stage go to the package's logger: `dflash2_mlx.log.setup()` prints them.
Module imports stay light here: the CLI imports `command.train_command` at start-up.
"""

from __future__ import annotations


def train_drafter(run: str, **options):
    """Run (or resume) the whole recipe into the folder `run`; -> the exported drafter folder.
    Options: the fields of `dflash2_mlx.train.config.Recipe`, `DrafterShape` and `TrainConfig`
    by name (`Recipe.from_options`)."""
    from .config import Recipe
    from .recipe import run_recipe

    return run_recipe(Recipe.from_options(run, **options))


__all__ = ["train_drafter"]
