"""Public names imported on first use (PEP 562), for packages whose import must stay light."""

from __future__ import annotations

from importlib import import_module


def exports(package: str, names: dict[str, str], namespace: dict):
    """(__getattr__, __dir__) for `package` whose public `names` map to the submodule that
    defines each; a name is imported on first access and then kept in `namespace`."""

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module '{package}' has no attribute '{name}'")
        value = getattr(import_module(f".{names[name]}", package), name)
        namespace[name] = value
        return value

    def __dir__():
        return sorted([*namespace, *names])

    return __getattr__, __dir__
