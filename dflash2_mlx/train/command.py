"""`dflash2-mlx train`: the typer entry point (registered by the CLI), its options built from the
fields of `config.Recipe` and its parts (name, default, help, validator), so a setting is
declared once.

Only typer and `config` are imported at module level; everything heavy loads when the command
runs.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Optional

import typer

from .. import settings
from .config import PARTS, Recipe, flat_fields


def _ints(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from None


def _callback(flag: str, validate, parse=None):
    """click callback: parse the flag's text (tuples of ints), then run the field's validator;
    a `SettingError` becomes click's "Invalid value for '--flag'" line."""
    def callback(value):
        if parse is not None:
            value = parse(value)
        if validate is None or value is None:
            return value
        try:
            return validate(value, flag)
        except settings.SettingError as e:
            raise typer.BadParameter(e.problem) from None
    return callback


def _element(hint) -> tuple[type | None, bool]:
    """(element type of a `tuple[X, ...]` hint or None, whether None is allowed)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = len(args) < len(typing.get_args(hint))
    inner = args[0] if optional and len(args) == 1 else hint
    if typing.get_origin(inner) is tuple:
        return typing.get_args(inner)[0], optional
    return None, optional


def _parameter(field: dataclasses.Field, hint) -> inspect.Parameter:
    """The typer option of one field: tuples of ints are comma-separated text, tuples of
    strings repeat the flag; everything else keeps its type."""
    meta = field.metadata
    flag = meta["flag"] or "--" + field.name.replace("_", "-")
    default = ... if field.default is dataclasses.MISSING else field.default
    element, optional = _element(hint)
    parse = None
    if element is int:
        annotation = Optional[str] if optional else str
        default = None if default is None else ",".join(map(str, default))
        parse = _ints
    elif element is str:
        annotation, default = list[str], list(default or ())
    else:
        annotation = hint
    info = typer.Option(default, *([meta["flag"]] if meta["flag"] else []), help=meta["help"],
                        metavar=meta["metavar"],
                        callback=_callback(flag.split("/")[0], meta["validate"], parse))
    return inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=info,
                             annotation=annotation)


def _signature() -> inspect.Signature:
    hints = {None: typing.get_type_hints(Recipe)}
    hints.update({part: typing.get_type_hints(kind) for part, kind in PARTS.items()})
    return inspect.Signature([_parameter(f, hints[part][f.name]) for part, f in flat_fields()
                              if f.metadata.get("help")])


def train_command(**options):
    """Train a DFlash / DFlash 2 drafter for a target: prompts -> target responses with features
    -> training -> export (resumable at every stage)."""
    from .. import log
    from .recipe import run_recipe

    log.setup()
    folder = run_recipe(Recipe.from_options(**options))
    typer.echo(str(folder))


train_command.__signature__ = _signature()
