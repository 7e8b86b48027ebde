"""Values of the plain attributes of a model's submodules, for the reuse fingerprint.

A module built with `scale=2.0` and rebuilt with `scale=3.0` has the same code and the same
parameter shapes, yet traces to another program (the value is baked into it). So the fingerprint
records, for every submodule, the values of its attributes, flat, keyed `<module path>.<attribute>`
(`blocks.0.scale`; the top module's without a path), as text:

- numbers, strings, bytes, None, enums, `torch.dtype`, `torch.device`: by value (their repr);
- tuples, lists, sets (sorted) and dicts of anything here, recursively (`table['key']`, `dims[1]`);
  one with more than `_MAX_ITEMS` items, or a text longer than `_MAX_TEXT`, by a digest;
- config objects (a class with `to_dict()`, such as transformers' `PretrainedConfig`; dataclasses;
  `SimpleNamespace`; `functools.partial`): their fields, as `config.rms_norm_eps`. One config met
  again (every layer holds the model's), or an equal one, is listed once, at its first path in
  module order; the others record `same as <first path>`;
- tensors: shape and dtype only (weights' values never enter), modules: their class (a submodule's
  own attributes are listed under its path); functions, classes and objects with no state of their
  own (diffusers' attention processors): name and a digest of their (class's) code.

Anything else (an arbitrary object) cannot be compared: it is left out and named in one
`AttributeWarning` per call, unless it is library bookkeeping (below). nn.Module's and
Lightning's bookkeeping (`_parameters`, hooks, `training`, the trainer) and what says where a
model came from (`_NOT_MODEL`: `_is_hf_initialized`, `name_or_path`, `transformers_version`,
`generation_config`) are not part of what forward computes: left out.

Library bookkeeping is left out quietly. The rule (`_is_bookkeeping`): an attribute whose name is
private (a leading underscore) on a module whose class derives from an installed third-party
library (a class of that package in its MRO; see `nnscaler.parallel.sources.installed_package`),
holding objects of that same library. That is the library keeping its own records in its own
private slots: transformers 5's `_weight_conversions` (the `WeightRenaming`/`WeightConverter`s
that `from_pretrained` applied to the checkpoint's names), which say how weights were loaded, not
what forward computes, and which the library's version (in `packages`) pins anyway. A public
attribute, an object of the user's own classes or of torch (`self._gen = torch.Generator()`), or any
attribute of a module of the user's own classes only, still warns: those are what a user set. Values
that would depend on the process's string hash seed are never recorded as they are: sets are
recorded sorted (a set of unrecordable objects is unrecordable), and GenerationConfig's
`_original_object_hash` is in `_NOT_MODEL`.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import hashlib
import types
import warnings
from typing import Any

import torch

from nnscaler.parallel.sources import digest, installed_package, is_library

__all__ = ["AttributeWarning", "attribute_values"]

_MAX_ITEMS = 64
"""A container with more items is recorded as one digest (e.g. a 1,000-label `id2label`)."""
_MAX_TEXT = 200
"""A longer value's text is recorded as a digest."""
_MAX_DEPTH = 8
"""Containers nested deeper (or containing themselves) are not recorded."""
_NOT_MODEL = frozenset(
    {
        "_is_hf_initialized",  # set by loading weights
        "_compiled_call_impl",  # set by torch.compile
        "name_or_path",  # where the weights came from
        "_name_or_path",
        "_commit_hash",
        "transformers_version",  # which version saved the config (the installed one is in `packages`)
        "generation_config",  # transformers' settings for generate(), which forward never reads
        "_original_object_hash",  # GenerationConfig's hash of itself: differs between processes
    }
)
"""Attributes and config fields that say where a model came from, not what forward computes."""
_SKIPPED = frozenset(vars(torch.nn.Module())) | _NOT_MODEL
"""... and nn.Module's own state (hooks, `_parameters`, `training`)."""
_FRAMEWORK_BASES = frozenset(
    {"lightning.pytorch.core.module.LightningModule", "pytorch_lightning.core.module.LightningModule"}
)
"""Base classes whose own state (what a bare instance holds: Lightning's trainer, device, hparams,
current hook name) is the framework's bookkeeping, not the model's."""
_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)
_OPS = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)


class AttributeWarning(UserWarning):
    """Model attributes whose values the reuse fingerprint cannot record (their changes go unseen)."""


@functools.cache
def _skipped(cls: type) -> frozenset[str]:
    """The attribute names of a `cls` instance that are not the model's (see _SKIPPED, _FRAMEWORK_BASES),
    and the values of its `functools.cached_property`s (derived, and there only once read)."""
    names = set(_SKIPPED)
    for base in cls.__mro__:
        names |= {k for k, v in vars(base).items() if isinstance(v, functools.cached_property)}
        if f"{base.__module__}.{base.__qualname__}" in _FRAMEWORK_BASES:
            try:
                names |= set(vars(base()))
            except Exception:  # noqa: BLE001 - a base that cannot be built bare: its state is compared
                pass
    return frozenset(names)


@functools.cache
def _libraries(cls: type) -> frozenset[str]:
    """The installed third-party packages that `cls` derives from (transformers for a Llama)."""
    return frozenset(p for c in cls.__mro__ if (p := installed_package(c)) is not None)


def _is_bookkeeping(cls: type, name: str, value_module: str) -> bool:
    """An unrecordable object of a library, in a private attribute of a module of that library's
    classes: the library's own records (the rule is in the module docstring)."""
    root = value_module.split(".")[0]
    return name.startswith("_") and root in _libraries(cls)


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def _digest_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _leaf(value: Any) -> str | None:
    """The text of a value recorded as a whole; None for containers, configs and unknown objects."""
    if isinstance(value, enum.Enum):
        return f"{_qualname(type(value))}.{value.name}"
    if isinstance(value, _PLAIN):
        text = repr(value)
        return text if len(text) <= _MAX_TEXT else f"<{type(value).__name__} sha256 {_digest_text(text)}>"
    if isinstance(value, torch.Tensor):
        return f"tensor {list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, torch.nn.Module):
        return f"module {_qualname(type(value))}"
    if isinstance(value, _OPS):
        return f"op {value}"
    if isinstance(value, type) or isinstance(value, (types.FunctionType, types.MethodType)):
        fn = value.__func__ if isinstance(value, types.MethodType) else value
        kind = "class" if isinstance(value, type) else "function"
        library = is_library(fn)  # covered by the torch / Python version
        return f"{kind} {_qualname(fn)}" + ("" if library else f" {digest(fn)}")
    if isinstance(value, types.BuiltinFunctionType):
        return f"builtin {_qualname(value)}"
    return None


def _object(value: Any) -> str | None:
    """An object with no state of its own (diffusers' attention processors): its class says it all."""
    if isinstance(value, (list, tuple, set, frozenset, dict)) or not _stateless(value):
        return None
    cls = type(value)
    return f"object {_qualname(cls)}" + ("" if is_library(cls) else f" {digest(cls)}")


def _stateless(value: Any) -> bool:
    """An instance with no state of its own: an empty `__dict__` and no slots."""
    if getattr(value, "__dict__", None) != {}:
        return False
    return all(set(getattr(c, "__slots__", ())) <= {"__dict__", "__weakref__"} for c in type(value).__mro__)


def _fields(value: Any) -> dict[str, Any] | None:
    """A config object's fields; None when `value` is not a config object."""
    if isinstance(value, functools.partial):
        return {"func": value.func, "args": value.args, "keywords": value.keywords}
    if callable(getattr(type(value), "to_dict", None)):  # before dataclasses: transformers' are both
        fields = getattr(value, "__dict__", None)
        if isinstance(fields, dict):  # with `_attn_implementation` and the like, which to_dict() drops
            return {k: v for k, v in fields.items() if k not in _NOT_MODEL}
        try:
            fields = value.to_dict()
        except Exception:  # noqa: BLE001 - a to_dict() that fails makes it an unknown object
            return None
        return {k: v for k, v in fields.items() if k not in _NOT_MODEL} if isinstance(fields, dict) else None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if hasattr(value, f.name)}
    if isinstance(value, (types.SimpleNamespace, argparse.Namespace)):
        return dict(vars(value))
    return None


class _Walker:
    """Collects `path -> text` entries and the paths of values it cannot record."""

    def __init__(self, inside: set[int] | None = None) -> None:
        self.out: dict[str, str] = {}
        self.problems: list[tuple[str, str, str]] = []  # (path, what, module of the object's class)
        self.first: dict[tuple, str] = {}  # a config's content -> the path it was first listed at
        self.memo: dict[int, tuple[Any, list[tuple[str, str]], list[tuple[str, str, str]]]] = {}
        self.inside = set() if inside is None else inside  # ids of the containers being walked

    def walk(self, path: str, value: Any, depth: int = 0) -> None:
        text = _leaf(value)
        if text is not None:
            self.out[path] = text
            return
        if id(value) in self.inside or depth >= _MAX_DEPTH:
            self.problems.append(
                (path, f"{_qualname(type(value))} nested too deeply or in itself", type(value).__module__)
            )
            return
        self.inside.add(id(value))
        try:
            if isinstance(value, (list, tuple, set, frozenset)):
                self.sequence(path, value, depth + 1)
            elif isinstance(value, dict):
                self.mapping(path, value, depth + 1)
            elif (fields := _fields(value)) is not None:
                self.config(path, value, fields, depth + 1)
            elif (text := _object(value)) is not None:
                self.out[path] = text
            else:
                self.problems.append((path, _qualname(type(value)), type(value).__module__))
        finally:
            self.inside.discard(id(value))

    def sequence(self, path: str, value: Any, depth: int) -> None:
        items = list(value)
        texts = [_leaf(v) for v in items]
        if isinstance(value, (set, frozenset)):
            if None in texts:  # an order of other objects is not reproducible: record what is known
                other = type(items[texts.index(None)])
                self.problems.append(
                    (path, f"{type(value).__name__} of {_qualname(other)}", other.__module__)
                )
                return
            texts.sort()
        if None not in texts:
            open_, close = _brackets(value)
            comma = "," if isinstance(value, tuple) and len(texts) == 1 else ""
            text = open_ + ", ".join(texts) + comma + close
            if len(text) > _MAX_TEXT:
                text = f"<{type(value).__name__} of {len(texts)} sha256 {_digest_text(text)}>"
            self.out[path] = text
            return
        self.many(path, value, list(enumerate(items)), depth)

    def mapping(self, path: str, value: dict, depth: int) -> None:
        if not value:
            self.out[path] = "{}"
            return
        items = []
        for k, v in value.items():
            key = _leaf(k)
            if key is None:
                self.problems.append(
                    (path, f"dict with a key of type {_qualname(type(k))}", type(k).__module__)
                )
                return
            items.append((key, v))
        self.many(path, value, items, depth)

    def many(self, path: str, value: Any, items: list[tuple[Any, Any]], depth: int) -> None:
        """`path[key]` for each item; one digest when there are more than _MAX_ITEMS."""
        if len(items) <= _MAX_ITEMS:
            for key, v in items:
                self.walk(f"{path}[{key}]", v, depth)
            return
        sub = _Walker(self.inside)
        for key, v in items:
            sub.walk(f"[{key}]", v, depth)
        self.problems += [(path + p, t, m) for p, t, m in sub.problems]
        self.out[path] = (
            f"<{type(value).__name__} of {len(items)} items, sha256 {_digest_text(repr(sorted(sub.out.items())))}>"
        )

    def config(self, path: str, value: Any, fields: dict[str, Any], depth: int) -> None:
        memo = self.memo.get(id(value))
        if memo is None:
            sub = _Walker(self.inside)
            for name, v in fields.items():
                sub.walk(f".{name}", v, depth)
            memo = (value, list(sub.out.items()), sub.problems)  # holds value: its id stays its own
            self.memo[id(value)] = memo
        _, entries, problems = memo
        key = (_qualname(type(value)), tuple(entries))
        if key in self.first:
            self.out[path] = f"same as {self.first[key]}"
            return
        self.first[key] = path
        self.out[path] = f"<{_qualname(type(value))}>"
        self.out.update((path + suffix, text) for suffix, text in entries)
        self.problems += [(path + p, t, m) for p, t, m in problems]


def _brackets(value: Any) -> tuple[str, str]:
    if isinstance(value, list):
        return "[", "]"
    if isinstance(value, tuple):
        return "(", ")"
    return ("{", "}") if value else ("set(", ")")


def attribute_values(module: torch.nn.Module, warn: bool = True) -> dict[str, str]:
    """`{'blocks.0.scale': '2.0', 'config.rms_norm_eps': '1e-06', ...}` for every submodule; values
    that cannot be recorded are named in one AttributeWarning (when `warn`) and left out."""
    walker = _Walker()
    for prefix, sub in module.named_modules(remove_duplicate=False):
        skipped = _skipped(type(sub))
        for name, value in vars(sub).items():
            if name not in skipped:
                before = len(walker.problems)
                walker.walk(f"{prefix}.{name}" if prefix else name, value)
                # bookkeeping is left out of the fingerprint like any unrecordable value, but quietly
                walker.problems[before:] = [
                    p for p in walker.problems[before:] if not _is_bookkeeping(type(sub), name, p[2])
                ]
    if warn and walker.problems:
        shown = ", ".join(f"`{p}` ({t})" for p, t, _ in walker.problems[:8])
        more = f" and {len(walker.problems) - 8} more" if len(walker.problems) > 8 else ""
        warnings.warn(
            f"the reuse fingerprint cannot record the values of model attributes {shown}{more}: they are left "
            "out, so reuse='match' / 'moo' / 'graph' cannot see them change. If forward reads them, keep plain "
            "values (numbers, strings, tuples, dicts, enums, dataclasses) on the module instead, or pass "
            "reuse='override' after changing them",
            AttributeWarning,
            stacklevel=3,
        )
    return walker.out
