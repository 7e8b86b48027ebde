"""Python side effects the trace drops: forward changing plain attributes of the model.

torch.export records tensor operations. Other Python statements in forward run while tracing and
never again: `self.calls += 1` counts the traces, and the generated code leaves `calls` alone (torch
even puts the attribute back after tracing). `watch_side_effects` takes the plain attributes
(numbers, strings, None, enums, dtypes, and tuples, lists, dicts and sets of them) of every
submodule before capture, compares them each time a forward call returns, and names each change
(module path, attribute, old -> new value) in one `SideEffectWarning` after the capture. Nothing is
restored. Tensors and other objects (caches a library keeps), `functools.cached_property` values
and nn.Module's own state (hooks, `training`, which the capture sets and restores) are not compared.

Under `ComputeConfig.torch_compile` (`refuse=`) the same changes raise a ConfigError naming each
attribute, the source line that changes it and the fix, instead of warning. Refused, not run eagerly:
`torch.compile(model)` itself replays such statements (dynamo tracks attribute writes: 1x, 2x, 3x),
so a user asking for torch_compile expects them kept, and the generated code cannot keep them whether
compiled or not, since the statement is not in it. Running "that module eagerly" would mean an opaque
leaf, which holds no side effect of the top module (whose forward is never a leaf), and which the
plan replicates instead of splitting: a silent slowdown traded for a silent change of numbers. Eager
generated code keeps the warning (its behaviour before torch_compile existed).
"""

from __future__ import annotations

import ast
import contextlib
import enum
import functools
import inspect
import os
import textwrap
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from nnscaler.errors import ConfigError

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
def watch_side_effects(module: torch.nn.Module, refuse: str | None = None) -> Iterator[None]:
    """Around a capture: warn after it, naming each plain attribute of `module` or a submodule that a
    call of `module` inside the block changed. Compared as each call returns (a forward hook), since
    torch.export puts attributes back after tracing; not checked when the block raises. With `refuse`
    (the setting that cannot keep them, e.g. 'ComputeConfig.torch_compile'): a ConfigError instead."""
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
    if refuse and seen:
        _refuse(module, refuse, seen)
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


_MUTATORS = frozenset(
    {"append", "extend", "insert", "pop", "remove", "clear", "update", "setdefault", "add", "discard", "sort"}
)


def _dotted(node: ast.AST) -> str:
    """'self.inner.last' for an attribute chain on a name; '' for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def _written(node: ast.AST) -> list[str]:
    """The attribute chains a statement or call writes: assignment and deletion targets (also
    `self.x[i] = ...`) and receivers of mutating methods (`self.seen.append(4)`)."""
    targets: list[ast.AST] = []
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = list(node.targets)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS:
        targets = [node.func.value]
    out = []
    while targets:
        t = targets.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            targets.extend(t.elts)
        elif isinstance(t, (ast.Subscript, ast.Starred)):
            targets.append(t.value)
        else:
            out.append(_dotted(t))
    return out


def _line_in_class(cls: type, chain: str) -> str | None:
    """'file.py:12 `self.calls += 1`' of the first statement in `cls` (or a base class of the user's)
    that writes `chain` ('self.calls'), or None."""
    for klass in cls.__mro__:
        if klass.__module__.startswith(("torch.", "builtins")) or klass is object:
            continue
        try:
            lines, start = inspect.getsourcelines(klass)
            tree = ast.parse(textwrap.dedent("".join(lines)))
            filename = os.path.basename(inspect.getsourcefile(klass) or "")
        except (OSError, TypeError, SyntaxError):
            continue
        methods = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in (
            n for m in methods if m.name != "__init__" for n in ast.walk(m)
        ):  # not the initial value
            if chain in _written(node):
                lineno = start + node.lineno - 1
                return f"{filename}:{lineno} `{lines[node.lineno - 1].strip()}`"
    return None


def source_line(root: torch.nn.Module, label: str) -> str:
    """Where the user's code changes attribute `label` ('inner.last' of `root`): the innermost module on
    its path whose class writes it, as 'file.py:12 `code`'; 'an unknown line' when none is found."""
    *path, name = label.split(".")
    for depth in range(len(path), -1, -1):
        owner = root.get_submodule(".".join(path[:depth]))
        found = _line_in_class(type(owner), ".".join(["self", *path[depth:], name]))
        if found:
            return found
    return "an unknown line"


def _refuse(root: torch.nn.Module, setting: str, seen: dict[str, str]) -> None:
    where = "; ".join(f"{change} at {source_line(root, label)}" for label, change in seen.items())
    raise ConfigError(
        f"{setting}: forward changes model attribute(s) {where}. The generated code repeats only the tensor "
        "operations of the trace, so compiled it would return on every call what the traced call returned, "
        "where the model itself (eager or under torch.compile) changes them on each call. Move such "
        "bookkeeping out of forward, or keep it in a buffer updated in place with tensor operations "
        "(`self.calls.add_(1)`), which the trace keeps; or set torch_compile=False to run the generated code "
        "eagerly with a SideEffectWarning"
    )
