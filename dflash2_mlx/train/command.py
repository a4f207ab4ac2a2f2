"""`dflash2-mlx train`: the typer-annotated entry point (registered by the CLI).

Only typer is imported at module level; everything heavy loads when the command runs.
"""

from __future__ import annotations

from typing import Optional

import typer

from .recipe import DEFAULT_COUNTS, Recipe

R = Recipe(run="")      # the defaults of every option: one place, `recipe.Recipe`


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise typer.BadParameter(f"{flag} takes comma-separated integers, got {text!r}")


def train_command(
    run: str = typer.Option(..., "--run", help="Run folder: every stage resumes from it."),
    model: Optional[str] = typer.Option(None, "--model", help="Target (mlx-lm folder, hub id or "
                                        ".gguf); default: the embedded SmolLM2-135M-Instruct."),
    data: list[str] = typer.Option([], "--data", metavar="STORE",
                                   help="Train on an existing feature store instead of "
                                   "generating one in <run>/data (repeatable: several stores "
                                   "of the same target train as one)."),
    out: Optional[str] = typer.Option(None, "--out", help="Export folder (default <run>/drafter)."),
    stdlib_functions: int = typer.Option(DEFAULT_COUNTS["stdlib_function"],
                                         help="Prompts: stdlib signatures + docstrings."),
    stdlib_tasks: int = typer.Option(DEFAULT_COUNTS["stdlib_task"],
                                     help="Prompts: 'write a function that ...'."),
    pydoc_topics: int = typer.Option(DEFAULT_COUNTS["pydoc_topic"],
                                     help="Prompts: CPython documentation topics."),
    self_chat: int = typer.Option(DEFAULT_COUNTS["self_chat"],
                                  help="Prompts: user turns sampled from the target."),
    doctest_functions: int = typer.Option(DEFAULT_COUNTS["doctest_function"],
                                          help="Prompts: functions with >>> examples (stdlib "
                                          "and installed packages)."),
    package_functions: int = typer.Option(DEFAULT_COUNTS["package_function"],
                                          help="Prompts: installed packages' signatures + "
                                          "docstrings."),
    exclude_prompts: list[str] = typer.Option([], "--exclude-prompts", metavar="FILE",
                                              help="An earlier run's "
                                              "prompts.jsonl: its prompts are not drawn again "
                                              "(repeatable; more data without repeats)."),
    sampled_fraction: float = typer.Option(R.sampled_fraction,
                                           help="Share of prompts also answered at T=1."),
    max_prompt_tokens: int = typer.Option(R.max_prompt_tokens),
    max_new_tokens: int = typer.Option(R.max_new_tokens),
    gen_batch: int = typer.Option(R.gen_batch, help="Sequences per generation batch."),
    layers: int = typer.Option(R.layers, help="Drafter depth."),
    block_size: int = typer.Option(R.block_size),
    target_layer_ids: str = typer.Option(",".join(map(str, R.target_layer_ids)),
                                         help="Target layers the drafter reads."),
    mask_token_id: Optional[int] = typer.Option(None, help="Default: 16 for SmolLM2."),
    conv: bool = typer.Option(True, "--conv/--no-conv", help="DFlash 2 short convolution."),
    selector: bool = typer.Option(True, "--selector/--no-selector", help="DFlash 2 selector."),
    selector_rank: int = typer.Option(R.selector_rank),
    init_from_target: bool = typer.Option(True, "--init-from-target/--random-init"),
    init_layers: Optional[str] = typer.Option(None, "--init-layers",
                                              help="Target layers the drafter's layers start "
                                              "from (one each; default: the last ones)."),
    init_from: Optional[str] = typer.Option(None, "--init-from", metavar="DRAFTER",
                                            help="Start from a drafter folder's weights "
                                            "instead (fine-tuning; e.g. the shipped one, "
                                            "dflash2_mlx/defaults)."),
    steps: int = typer.Option(R.steps),
    lr: float = typer.Option(R.lr),
    seqs: int = typer.Option(R.seqs, help="Sequences per step."),
    anchors: int = typer.Option(R.anchors, help="Random anchors per sequence per step."),
    gamma: Optional[float] = typer.Option(None, help="Position decay (default 4 for b=8)."),
    soft: float = typer.Option(R.soft, help="Weight of the distillation term (0: hard labels)."),
    copy_weight: float = typer.Option(R.copy_weight, help="Extra loss weight of the block rows "
                                      "a context lookup would copy (0: none)."),
    ckpt_every: int = typer.Option(R.ckpt_every),
    snapshot_every: int = typer.Option(R.snapshot_every,
                                       help="Also keep the weights every N steps (trend)."),
    max_minutes: Optional[float] = typer.Option(None, help="Stop training (checkpointed, "
                                                "resumable) after this many minutes."),
    seed: int = typer.Option(R.seed),
    bits: Optional[int] = typer.Option(None, help="Export quantized: 4 or 8."),
    stop_after: str = typer.Option(R.stop_after, help="data | train | export"),
):
    """Train a DFlash / DFlash 2 drafter for a target: prompts -> target responses with features
    -> training -> export (resumable at every stage)."""
    if stop_after not in ("data", "train", "export"):
        raise typer.BadParameter(f"--stop-after must be data, train or export, got {stop_after!r}")
    if bits not in (None, 4, 8):
        raise typer.BadParameter(f"--bits must be 4 or 8, got {bits}")
    from .recipe import Recipe, run_recipe

    recipe = Recipe(
        run=run, model=model, data=tuple(data) or None, out=out,
        counts={"stdlib_function": stdlib_functions, "stdlib_task": stdlib_tasks,
                "pydoc_topic": pydoc_topics, "self_chat": self_chat,
                "doctest_function": doctest_functions, "package_function": package_functions},
        exclude_prompts=tuple(exclude_prompts),
        sampled_fraction=sampled_fraction, max_prompt_tokens=max_prompt_tokens,
        max_new_tokens=max_new_tokens, gen_batch=gen_batch, layers=layers,
        block_size=block_size, target_layer_ids=_ints(target_layer_ids, "--target-layer-ids"),
        mask_token_id=mask_token_id, conv=conv, selector=selector, selector_rank=selector_rank,
        init_from_target=init_from_target,
        init_layers=_ints(init_layers, "--init-layers") if init_layers else None,
        init_from=init_from,
        steps=steps, lr=lr, seqs=seqs, anchors=anchors,
        gamma=gamma, soft=soft, copy_weight=copy_weight, ckpt_every=ckpt_every,
        snapshot_every=snapshot_every,
        max_minutes=max_minutes, seed=seed, bits=bits,
        stop_after=stop_after)
    folder = run_recipe(recipe, log=lambda line: typer.echo(line, err=True))
    typer.echo(str(folder))
