"""Python side effects the trace drops: forward changing plain attributes of the model.

torch.export records tensor operations. Other Python statements in forward run while tracing and
never again: `self.calls += 1` counts the traces, and the generated code leaves `calls` alone (torch
even puts the attribute back after tracing). `watch_side_effects` takes the plain attributes
(numbers, strings, None, enums, dtypes, and tuples, lists, dicts and sets of them) of every
submodule before capture, compares them each time a forward call returns, and names each change
(module path, attribute, old -> new value) in one `SideEffectWarning` after the capture. Nothing is
restored. Tensors and other objects (caches a library keeps), `functools.cached_property` values
and nn.Module's own state (hooks, `training`, which the capture sets and restores) are not compared.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SideEffectWarning", "Snapshot", "snapshot", "watch_side_effects"]

_SKIPPED = frozenset(vars(torch.nn.Module())) | {"_is_hf_initialized"}
"""nn.Module's own state (hooks, `_parameters`, `training`) and flags libraries set on loading."""
_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, enum.Enum)
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)
_OPAQUE = object()  # a value not compared (a tensor, an object)
_ABSENT = object()  # no such attribute


class SideEffectWarning(UserWarning):
    """forward changed plain attributes of the model while traced: the generated code will not."""


@dataclass(frozen=True)
class Snapshot:
    """The plain attributes of each submodule before capture: `(path, module, {name: (value, text)})`."""

    modules: tuple[tuple[str, torch.nn.Module, dict[str, tuple[Any, str]]], ...]


def _frozen(value: Any) -> Any:
    """A comparable copy of a plain value (type-tagged, so 1 != True and nan == nan); _OPAQUE otherwise."""
    if isinstance(value, float):
        return ("float", value.hex())
    if isinstance(value, _PLAIN):
        return (type(value), value)
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_frozen(v) for v in value]
        if any(i is _OPAQUE for i in items):
            return _OPAQUE
        return (type(value), frozenset(items) if isinstance(value, (set, frozenset)) else tuple(items))
    if isinstance(value, dict):
        items = [(_frozen(k), _frozen(v)) for k, v in value.items()]
        if any(_OPAQUE in kv for kv in items):
            return _OPAQUE
        return (type(value), tuple(items))
    return _OPAQUE


def _symbolic(value: Any) -> bool:
    """A number traced symbolically (a size of a dynamic dim), or a plain container holding one."""
    if isinstance(value, _SYMBOLIC):
        return True
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_symbolic(v) for v in value)
    if isinstance(value, dict):
        return any(_symbolic(v) for v in value.values())
    return False


def _cached(module: torch.nn.Module, name: str) -> bool:
    """A `functools.cached_property` of the module's class: computed on first read, not a side effect."""
    return isinstance(getattr(type(module), name, None), functools.cached_property)


def _attributes(module: torch.nn.Module) -> dict[str, tuple[Any, str]]:
    """`{name: (frozen value, its text)}`; the text is taken now, since a list may change in place."""
    out = {}
    for name, value in vars(module).items():
        if name not in _SKIPPED and not _cached(module, name):
            frozen = _frozen(value)
            out[name] = (frozen, "" if frozen is _OPAQUE else _show(value))
    return out


def snapshot(module: torch.nn.Module) -> Snapshot:
    """The plain attributes of `module` and every submodule, as they are now."""
    return Snapshot(tuple((path, sub, _attributes(sub)) for path, sub in module.named_modules()))


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _changes(before: Snapshot) -> list[tuple[str, str]]:
    """`(attribute path, "`path` (old -> new)")` for each plain attribute changed since `before`."""
    out = []
    for path, sub, old in before.modules:
        now = vars(sub)
        for name in [*old, *(n for n in now if n not in old and n not in _SKIPPED and not _cached(sub, n))]:
            was, was_text = old.get(name, (_ABSENT, "<not set>"))
            if was is _OPAQUE:
                continue
            value = now.get(name, _ABSENT)
            frozen = _ABSENT if value is _ABSENT else _frozen(value)
            if frozen is _OPAQUE and not _symbolic(value):
                continue  # now a tensor or an object (a cache): not a plain value forward computed
            if frozen == was:
                continue
            label = f"{path}.{name}" if path else name
            out.append(
                (label, f"`{label}` ({was_text} -> {'<not set>' if value is _ABSENT else _show(value)})")
            )
    return out


@contextlib.contextmanager
def watch_side_effects(module: torch.nn.Module) -> Iterator[None]:
    """Around a capture: warn after it, naming each plain attribute of `module` or a submodule that a
    call of `module` inside the block changed. Compared as each call returns (a forward hook), since
    torch.export puts attributes back after tracing; not checked when the block raises."""
    before = snapshot(module)
    seen: dict[str, str] = {}

    def check(*_: Any) -> None:
        for label, change in _changes(before):
            seen.setdefault(label, change)

    handle = module.register_forward_hook(check, always_call=True)
    try:
        yield
    finally:
        handle.remove()
    check()
    _warn(list(seen.values()))


def _warn(changes: list[str]) -> None:
    if not changes:
        return
    shown = ", ".join(changes[:8]) + (f" and {len(changes) - 8} more" if len(changes) > 8 else "")
    warnings.warn(
        f"tracing forward changed model attribute(s) {shown}: Python statements in forward run only "
        "while the model is traced, so the generated code will never change them (it repeats tensor "
        "operations only). Move such bookkeeping out of forward, or keep it in a buffer updated with "
        "tensor operations",
        SideEffectWarning,
        stacklevel=4,
    )
