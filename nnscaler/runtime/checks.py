"""The model's value checks in generated code: `if labels.max() >= n: raise ValueError(...)`,
`assert cond, msg` and `torch._assert(cond, msg)` were traced as assumptions
(nnscaler/graph/capture/value_checks.py) and are checked here, on each rank's own values.

The exception is the model's own type and message; a note names the source line of the check and
the rank that saw the bad value.
"""

from __future__ import annotations

import builtins
import importlib

import torch

__all__ = ["raise_if", "raise_unless"]


def _exception_class(name: str) -> type[BaseException] | None:
    """'ValueError' (a builtin) or 'package.module:Qualname'; None when it cannot be found."""
    if ":" not in name:
        found = getattr(builtins, name, None)
    else:
        module, qualname = name.split(":", 1)
        try:
            found = importlib.import_module(module)
            for part in qualname.split("."):
                found = getattr(found, part)
        except (ImportError, AttributeError):
            found = None
    return found if isinstance(found, type) and issubclass(found, BaseException) else None


def _rank() -> str:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return f"rank {torch.distributed.get_rank()}"
    return "this process"


def _fail(exc: str | type[BaseException], message: str, where: str) -> None:
    cls = exc if isinstance(exc, type) else _exception_class(exc)
    error: BaseException
    try:
        error = cls(message) if cls is not None else RuntimeError(f"{exc}: {message}")
    except Exception:  # noqa: BLE001 - a class that takes other arguments: its name and the message
        error = RuntimeError(f"{getattr(cls, '__name__', exc)}: {message}")
    error.add_note(f"value check at {where} failed on {_rank()} (nnscaler traced it as an assumption)")
    raise error


def raise_if(cond: torch.Tensor, exc: str | type[BaseException], message: str, where: str) -> None:
    """Raise `exc(message)` when `cond` is true (`if cond: raise exc(message)` at `where`); a condition
    checked element by element (this rank's part of it) when any element is."""
    if bool(cond.any()):
        _fail(exc, message, where)


def raise_unless(cond: torch.Tensor, exc: str | type[BaseException], message: str, where: str) -> None:
    """Raise `exc(message)` when `cond` is false (`assert cond, message` at `where`); element by
    element: when any element is."""
    if not bool(cond.all()):
        _fail(exc, message, where)
