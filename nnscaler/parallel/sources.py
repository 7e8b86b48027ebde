"""Which user source code shapes the generated code: the model's module classes and what they call.

Two parts, both maps from a qualified name to a short digest of its code:

- `module_sources`: every class in the MRO of every submodule's class, except torch's and Python's
  own (those are covered by the torch version). A whole class is hashed, so class attributes and
  every method count, not only `forward`.
- `helper_sources`: what those classes' code reaches by name, starting from each `forward` and
  following calls of methods of the model's classes (`self.<method>`, `self.norm.<method>`):
  module-level functions and classes of the same top-level package (the model's own package; e.g.
  `mypkg.layers.rotate` called from `mypkg.attention.Attention`), recursively, and plain constants
  they read (`SCALE = 2.0`, recorded by value). Names are read from the compiled code objects
  (`co_names`), so aliases and nested functions are found without parsing. Helpers reached only
  through containers (a dict of functions) are not followed; the installed version of each model
  package (`package_versions`) covers that for libraries such as transformers.

The digests are of the code as compiled in this process (bytecode, names, constants, defaults;
not line numbers, comments or docstrings of classes), not of the files on disk: they describe what
tracing runs. So an edit counts once the module is imported again (`importlib.reload`, a new
process), and a file edited but not re-imported cannot make stale code look current. Code typed in
a notebook cell or made by `exec` is covered the same way.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import sys
import sysconfig
import types
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "module_classes",
    "module_sources",
    "helper_sources",
    "package_versions",
    "digest",
    "is_library",
    "installed_package",
]

_LIBRARY_ROOTS = frozenset({"torch", "__future__"} | set(sys.stdlib_module_names))
"""Packages whose code is covered by the torch / Python version rather than hashed."""
_MAX_HELPERS = 2000  # bound the walk on very large packages; the package version covers the rest
_CONSTANTS = (bool, int, float, complex, str, bytes, type(None))


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _root(module_name: str | None) -> str:
    return (module_name or "").split(".")[0]


def is_library(obj: Any) -> bool:
    """Code of torch, the standard library or `object`: covered by the torch / Python version, not hashed."""
    return _root(getattr(obj, "__module__", None)) in _LIBRARY_ROOTS or obj is object


def installed_package(cls: type) -> str | None:
    """The top-level package of `cls` when it is a third-party library installed into site-packages
    (transformers, diffusers; its version pins its code); None for user code (editable installs
    included), torch and the standard library."""
    root = _root(getattr(cls, "__module__", None))
    return root if root not in _LIBRARY_ROOTS and _installed(root) else None


@cache
def _site_dirs() -> tuple[Path, ...]:
    paths = sysconfig.get_paths()
    return tuple({Path(paths[k]).resolve() for k in ("purelib", "platlib") if k in paths})


@lru_cache(maxsize=256)
def _installed(root: str) -> bool:
    """True for a package installed into site-packages (not editable): its version pins its code."""
    module = sys.modules.get(root)
    file = getattr(module, "__file__", None)
    if not file:
        return False
    path = Path(file).resolve()
    return any(path.is_relative_to(d) for d in _site_dirs())


def _const_text(value: Any) -> str:
    """A code constant's text; a frozenset's (`x in {"a", "b"}`) sorted, since its order follows the
    process's string hash seed and would make the digest differ between processes."""
    if isinstance(value, types.CodeType):
        return _code_text(value)
    if isinstance(value, frozenset):
        return "frozenset(" + repr(sorted(_const_text(v) for v in value)) + ")"
    if isinstance(value, tuple):
        return "(" + ", ".join(_const_text(v) for v in value) + ",)"
    return repr(value)


def _code_text(code: types.CodeType) -> str:
    """A line-number-free text of a code object and the code objects nested in it."""
    consts = [_const_text(c) for c in code.co_consts]
    return f"{code.co_code.hex()}|{code.co_names}|{code.co_varnames}|{code.co_freevars}|{consts}"


def _value_text(value: Any) -> str:
    """Plain values by value, anything else by its type (an address must never enter a digest)."""
    if isinstance(value, _CONSTANTS):
        return repr(value)
    if isinstance(value, (tuple, list, frozenset)) and all(isinstance(v, _CONSTANTS) for v in value):
        return repr(sorted(value, key=repr) if isinstance(value, frozenset) else value)
    return f"<{_qualname(type(value))}>"


def _function_text(fn: Any) -> str | None:
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    defaults = [_value_text(d) for d in getattr(fn, "__defaults__", None) or ()]
    kwdefaults = {k: _value_text(v) for k, v in (getattr(fn, "__kwdefaults__", None) or {}).items()}
    return f"{_code_text(code)}|{defaults}|{sorted(kwdefaults.items())}"


def _member_text(value: Any) -> str:
    if isinstance(value, property):
        parts = [_function_text(f) for f in (value.fget, value.fset, value.fdel) if f is not None]
        return "property:" + "|".join(p or "" for p in parts)
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, type):
        return f"class {_qualname(value)}"
    text = _function_text(value) if callable(value) else None
    return text if text is not None else _value_text(value)


_SKIPPED_MEMBERS = frozenset({"__dict__", "__weakref__", "__module__", "__doc__", "__qualname__"})


def digest(obj: Any) -> str:
    """sha256 (16 hex digits) of the code of a class (its bases and every member: methods, properties,
    class attributes) or of a function, as compiled in this process: what tracing runs."""
    if isinstance(obj, type):
        members = sorted((k, _member_text(v)) for k, v in vars(obj).items() if k not in _SKIPPED_MEMBERS)
        text = f"{[_qualname(b) for b in obj.__bases__]}|{members}"
    else:
        text = _function_text(obj) or _value_text(obj)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def module_classes(module: torch.nn.Module) -> list[type]:
    """Every non-library class in the MRO of every submodule's class, in first-seen order."""
    seen: dict[type, None] = {}
    for sub in module.modules():
        for cls in type(sub).__mro__:
            if not is_library(cls):
                seen.setdefault(cls, None)
    return list(seen)


def module_sources(module: torch.nn.Module) -> dict[str, str]:
    """{'pkg.attention.Attention': digest} for every class from `module_classes`."""
    return {_qualname(cls): digest(cls) for cls in module_classes(module)}


def package_versions(module: torch.nn.Module) -> dict[str, str]:
    """Installed versions of the top-level packages the model's classes come from (when installed)."""
    out = {}
    for root in sorted({_root(cls.__module__) for cls in module_classes(module)}):
        try:
            out[root] = importlib.metadata.version(root)
        except (importlib.metadata.PackageNotFoundError, ValueError):
            continue
    return out


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _function_of(member: Any) -> Any:
    if isinstance(member, (staticmethod, classmethod)):
        member = member.__func__
    if isinstance(member, property):
        member = member.fget
    return inspect.unwrap(member) if callable(member) else None


class _Walker:
    """Follows names from functions to the helpers of the same top-level package they reach.

    `methods` maps a method name to the functions of that name defined on the model's classes, so
    a call `self.<name>(...)` or `self.block.<name>(...)` is followed into the class that defines it.
    """

    def __init__(self, methods: dict[str, list[Any]]) -> None:
        self.methods = methods
        self.found: dict[str, str] = {}
        self.seen: set[int] = set()

    def function(self, fn: Any) -> None:
        code = getattr(fn, "__code__", None)
        if code is None or id(code) in self.seen or len(self.seen) > _MAX_HELPERS or is_library(fn):
            return
        self.seen.add(id(code))
        package = _root(getattr(fn, "__module__", None))
        names = _names(code)
        glb = getattr(fn, "__globals__", {})
        for name in sorted(names):
            for method in self.methods.get(name, ()):
                self.function(method)
            if name in glb:
                self.value(f"{glb.get('__name__', '?')}.{name}", glb[name], package, names)

    def value(self, label: str, value: Any, package: str, names: set[str]) -> None:
        if isinstance(value, types.ModuleType):
            if _root(value.__name__) == package and id(value) not in self.seen:
                self.seen.add(id(value))
                for name in sorted(names):
                    if name in vars(value):
                        self.value(f"{value.__name__}.{name}", vars(value)[name], package, names)
            return
        if isinstance(value, _CONSTANTS) or (
            isinstance(value, (tuple, frozenset)) and all(isinstance(v, _CONSTANTS) for v in value)
        ):
            self.found[label] = repr(value)
            return
        if _root(getattr(value, "__module__", None)) != package:
            return
        if isinstance(value, type):
            name = _qualname(value)
            if name not in self.found:
                self.found[name] = digest(value)
                for member in vars(value).values():
                    method = _function_of(member)
                    if method is not None:
                        self.function(method)
        elif isinstance(value, (types.FunctionType, types.MethodType)) or hasattr(value, "__wrapped__"):
            fn = inspect.unwrap(value)
            name = _qualname(fn)
            if name not in self.found and hasattr(fn, "__code__"):
                self.found[name] = digest(fn)
                self.function(fn)


def helper_sources(module: torch.nn.Module) -> dict[str, str]:
    """{qualified name: digest or constant repr} of what the model's forward code reaches by name.

    Classes from packages installed into site-packages (transformers, ...) are not walked: their
    version (`package_versions`) pins their code. Editable installs and code on sys.path are walked.
    """
    classes = [c for c in module_classes(module) if not _installed(_root(c.__module__))]
    methods: dict[str, list[Any]] = {}
    for cls in classes:
        for name, member in vars(cls).items():
            fn = _function_of(member)
            if fn is not None and hasattr(fn, "__code__"):
                methods.setdefault(name, []).append(fn)
    walker = _Walker(methods)
    for cls in classes:
        forward = _function_of(vars(cls).get("forward"))
        if forward is not None:
            walker.function(forward)
    own = {_qualname(cls) for cls in classes}
    return {k: v for k, v in sorted(walker.found.items()) if k not in own}
