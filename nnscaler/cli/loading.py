"""`load_type("pkg.mod.Class.attr")`: the object a dotted name (or a builtin name) refers to."""

from __future__ import annotations

import builtins
import importlib
from typing import Any

from nnscaler.errors import ConfigError

__all__ = ["load_type", "TypeLoadError"]


class TypeLoadError(ConfigError, RuntimeError):
    """A dotted name in the config does not name an importable object; the message says which part."""


def load_type(type_name: Any) -> Any:
    """The object `type_name` names: a builtin (`int`), or `module.path.attr[.attr...]`, importing the
    longest importable module prefix. A non-string is returned as it is (already an object)."""
    if not isinstance(type_name, str):
        return type_name
    if not type_name:
        raise TypeLoadError(
            "an empty type name was given where a dotted name (e.g. torch.optim.AdamW) is needed"
        )
    parts = type_name.split(".")
    if hasattr(builtins, parts[0]):
        obj: Any = getattr(builtins, parts[0])
        rest = parts[1:]
    else:
        obj, rest = None, []
        for i in range(len(parts), 0, -1):
            module_name = ".".join(parts[:i])
            try:
                obj = importlib.import_module(module_name)
            except ModuleNotFoundError as err:
                if err.name is not None and not module_name.startswith(err.name):
                    raise  # the module exists but one of its own imports is missing
                continue
            rest = parts[i:]
            break
        if obj is None:
            raise TypeLoadError(
                f"cannot load {type_name!r}: no module {parts[0]!r} is importable. `nnscaler-train` and "
                "`python -m nnscaler.cli.train` import from the directory they start in: run them where "
                f"{parts[0]} (or its package) is, or add its directory to PYTHONPATH"
            )
    for i, attr in enumerate(rest):
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            where = ".".join(parts[: len(parts) - len(rest) + i])
            raise TypeLoadError(f"cannot load {type_name!r}: {where!r} has no attribute {attr!r}") from None
    return obj
