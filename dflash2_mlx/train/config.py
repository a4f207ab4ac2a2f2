"""The settings of a training run as dataclasses, each field the one place of its default.

`Recipe` holds the run's own settings (paths, prompts, generation, initialisation, export) and
two parts: `DrafterShape` (what `init.drafter_args_for` builds) and `TrainConfig` (what
`trainer.train` runs). A field declared with `option(...)` is also a `dflash2-mlx train` flag
(`command.py` builds them from the fields: name, default, help) and an option of
`train_drafter`; the others are set from Python only.

Only the standard library and `..settings` load here: the CLI reads this module at start-up.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Callable

from .. import settings

STAGES = ("data", "train", "export")
EXPORT_BITS = (4, 8)


def option(default=MISSING, help: str = "", *, flag: str | None = None,
           metavar: str | None = None, validate: Callable | None = None):
    """A dataclass field that is also a flag. flag: the declaration when the field's name does
    not give it (e.g. "--init-from-target/--random-init"); validate(value, name) -> value: run
    on the Python value and on the flag's (a `settings` validator where one exists)."""
    meta = {"help": help, "flag": flag, "metavar": metavar, "validate": validate}
    return field(default=default, metadata=meta)


def one_of(allowed: tuple, expected: str):
    """A validator for a setting with a few allowed values (None passes)."""
    def validate(value, name: str):
        if value is not None and value not in allowed:
            raise settings.SettingError(name, value, expected)
        return value
    return validate


def run_checks(obj) -> None:
    """Run every field's validator on its value (in `__post_init__`)."""
    for f in fields(obj):
        validate = f.metadata.get("validate")
        if validate is not None:
            setattr(obj, f.name, validate(getattr(obj, f.name), f.name))


@dataclass
class DrafterShape:
    """The drafter's own shape; its width, heads and RoPE come from the target."""

    layers: int = option(2, "Drafter depth.")
    block_size: int = option(8, "Tokens per drafted block (the anchor and B-1 masks).")
    target_layer_ids: tuple[int, ...] = option((1, 8, 15, 22, 27),
                                               "Target layers the drafter reads.")
    mask_token_id: int | None = option(None, "Default: 16 for SmolLM2, else the last id.")
    conv: bool = option(True, "DFlash 2 short convolution.")
    selector: bool = option(True, "DFlash 2 selector.")
    selector_rank: int = option(128, "Rank of the selector's codebooks.")
    selector_top_k: int = 16                   # candidates the selector walks
    intermediate_size: int | None = None       # None: the target's MLP width
    max_position_embeddings: int = 8192

    def __post_init__(self):
        self.target_layer_ids = tuple(int(i) for i in self.target_layer_ids)


@dataclass
class TrainConfig:
    """The training loop (`trainer.train`)."""

    steps: int = option(1500, "Optimisation steps.")
    lr: float = option(1e-3, "Peak learning rate.")
    warmup: float = 0.04            # fraction of the steps
    min_lr: float = 0.1             # final learning rate, as a fraction of lr (cosine decay)
    weight_decay: float = 0.01
    clip: float = 1.0
    seqs: int = option(4, "Sequences per step.")
    anchors: int = option(64, "Random anchors per sequence per step (fewer when the response "
                          "is shorter).")
    gamma: float | None = option(None, "Position decay (default 4 for b=8).")
    soft: float = option(0.5, "Weight of the distillation term (0: hard labels).")
    soft_k: int = 8                 # teacher ids used by the distillation term
    copy_weight: float = option(0.0, "Extra loss weight of the block rows a context lookup "
                                "would copy (0: none).")
    selector_weight: float = 1.0
    vocab: str = "data"             # "data": restricted training softmax; "full"
    ckpt_every: int = option(100, "Checkpoint every N steps.")
    keep_ckpts: int = 2
    snapshot_every: int = option(0, "Also keep the weights every N steps (trend; 0: no).")
    max_minutes: float | None = option(None, "Stop training (checkpointed, resumable) after "
                                       "this many minutes.")
    seed: int = option(0, "Seed of the run: prompts drawn, sampled answers, initialisation, "
                       "anchors.", validate=settings.seed)
    compile: bool = False           # no gain measured on CPU, and it needs host_exp off

    def __post_init__(self):
        run_checks(self)


@dataclass
class Recipe:
    """The whole run (`recipe.run_recipe`); see `dflash2_mlx.train` for the stages."""

    run: str = option(help="Run folder: every stage resumes from it.", flag="--run")
    model: str | None = option(None, "Target (mlx-lm folder, hub id or .gguf); default: the "
                               "embedded SmolLM2-135M-Instruct.")
    data: tuple[str, ...] | None = option(
        None, "Train on an existing feature store instead of generating one in <run>/data "
        "(repeatable: several stores of the same target train as one).", metavar="STORE")
    out: str | None = option(None, "Export folder (default <run>/drafter).")
    # prompts per source (`prompts.offline_prompts`; "self_chat": sampled from the target)
    stdlib_functions: int = option(400, "Prompts: stdlib signatures + docstrings.")
    stdlib_tasks: int = option(150, "Prompts: 'write a function that ...'.")
    pydoc_topics: int = option(40, "Prompts: CPython documentation topics.")
    self_chat: int = option(32, "Prompts: user turns sampled from the target.")
    doctest_functions: int = option(200, "Prompts: functions with >>> examples (stdlib and "
                                    "installed packages).")
    package_functions: int = option(100, "Prompts: installed packages' signatures + "
                                    "docstrings.")
    exclude_prompts: tuple[str, ...] = option(
        (), "An earlier run's prompts.jsonl: its prompts are not drawn again (repeatable; more "
        "data without repeats).", metavar="FILE")
    # generation
    sampled_fraction: float = option(0.25, "Share of prompts also answered at T=1.")
    max_prompt_tokens: int = option(320, "Longer prompts are dropped.")
    max_new_tokens: int = option(160, "Tokens per answer, at most.", validate=settings.max_tokens)
    gen_batch: int = option(64, "Sequences per generation batch.")  # 117 new tok/s, 85 at 16
    capture_layers: tuple[int, ...] | None = None   # None: target_layer_ids + copied inputs
    drafter: DrafterShape = field(default_factory=DrafterShape)
    # initialisation
    init_from_target: bool = option(True, "Copy the target's last layers into the drafter.",
                                    flag="--init-from-target/--random-init")
    init_layers: tuple[int, ...] | None = option(
        None, "Target layers the drafter's layers start from (one each; default: the last ones).")
    init_from: str | None = option(None, "Start from a drafter folder's weights instead "
                                   "(fine-tuning; e.g. the shipped one, dflash2_mlx/loading/defaults).",
                                   metavar="DRAFTER")
    heads: str | None = option(None, "Train only this head of the --init-from drafter, its "
                               "backbone frozen: confidence (DSpark's acceptance predictor).",
                               validate=one_of(("confidence",), "confidence"))
    train: TrainConfig = field(default_factory=TrainConfig)
    # export
    bits: int | None = option(None, "Export quantized: 4 or 8.",
                              validate=one_of(EXPORT_BITS, "4 or 8"))
    stop_after: str = option("export", "data | train | export",
                             validate=one_of(STAGES, "one of data, train, export"))

    def __post_init__(self):
        # paths may come as Path objects from Python callers; recipe.json needs strings
        self.run = str(self.run)
        for name in ("model", "out", "init_from"):
            if getattr(self, name) is not None:
                setattr(self, name, str(getattr(self, name)))
        if self.data is not None:
            data = (self.data,) if isinstance(self.data, (str, Path)) else self.data
            self.data = tuple(str(d) for d in data) or None
        self.exclude_prompts = tuple(str(p) for p in self.exclude_prompts)
        for name in ("init_layers", "capture_layers"):
            if getattr(self, name) is not None:
                setattr(self, name, tuple(int(i) for i in getattr(self, name)))
        run_checks(self)

    @property
    def counts(self) -> dict[str, int]:
        """Prompts per source, by the source names of `prompts.offline_prompts`."""
        return {source: getattr(self, name) for name, source in COUNT_FIELDS.items()}

    @classmethod
    def from_options(cls, run, **options) -> "Recipe":
        """A recipe from flat options: the fields of `Recipe`, `DrafterShape` and
        `TrainConfig` by name (what `train_drafter` and the flags take); `drafter=` and
        `train=` may also give a whole part."""
        parts = {name: dict() for name in PARTS}
        own = {}
        for name, value in options.items():
            part = OWNER.get(name, ...)
            if part is ...:
                raise TypeError(f"unknown training option {name!r}")
            (own if part is None else parts[part])[name] = value
        for name, kind in PARTS.items():
            base = own.get(name, kind())
            own[name] = dataclasses.replace(base, **parts[name]) if parts[name] else base
        return cls(run=run, **own)


# the fields of the prompt counts -> the sources of `prompts.offline_prompts`
COUNT_FIELDS = {"stdlib_functions": "stdlib_function", "stdlib_tasks": "stdlib_task",
                "pydoc_topics": "pydoc_topic", "self_chat": "self_chat",
                "doctest_functions": "doctest_function", "package_functions": "package_function"}
PARTS = {"drafter": DrafterShape, "train": TrainConfig}      # the parts `Recipe` holds


def flat_fields() -> list[tuple[str | None, dataclasses.Field]]:
    """(part or None, field) for every setting of a run, in the order of `Recipe`, each part's
    fields in its place: the options of `Recipe.from_options` and, with a help, the flags."""
    out = []
    for f in fields(Recipe):
        if f.name in PARTS:
            out += [(f.name, g) for g in fields(PARTS[f.name])]
        else:
            out.append((None, f))
    return out


OWNER = {f.name: part for part, f in flat_fields()} | {name: None for name in PARTS}
