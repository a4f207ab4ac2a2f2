"""Training DFlash / DFlash 2 drafters with MLX (issue #5, SPEC section 5).

Stages, each resumable from what it left on disk:

  prompts    offline sources only (`prompts.py`): Python standard-library functions and
             docstrings, the documentation topics that ship with CPython, user turns sampled
             from the target's own chat template
  generate   the TARGET answers them (batched, greedy and sampled); the hidden states of the
             chosen layers and the target's top-k next-token distribution are captured during
             generation and stored on disk (fp16 features, uint16 ids) by `data.py`
  train      `trainer.py`: every response position is an anchor, the context K/V of a sequence
             are computed once, blocks see features before their anchor and their own rows only
             (`masks.py`); weighted CE / distillation + the selector's candidate CE (`losses.py`)
  export     `export.py`: the published checkpoint layout (SPEC section 4)
  evaluate   `evaluate.py`: offline tau / recall on HumanEval prompts by teacher forcing, and
             real generation through `dflash2_mlx.load`

Module imports stay light here: the CLI imports `command.train_command` at start-up.
"""
