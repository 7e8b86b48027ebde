"""Does a module's forward depend on train()/eval() at all?

`train()`/`eval()` change nothing but the `training` attribute of each submodule, so a forward whose
code never reads an attribute named `training` traces to the same program in both modes, and the
second trace (`modes.trace_both_modes`) can be skipped: it costs as much as the first.

The scan is conservative: it reads the bytecode of every method of every submodule class (whole MRO
but `nn.Module` itself, whose `train()` is not forward code) and of the Python functions they reach
by global name, transitively, in any package; a name or string constant `training` anywhere counts
as a read. A class or function it cannot read (no bytecode), or more code than `_MAX_FUNCTIONS`,
counts as a read too. Written here (not taken from `parallel.sources`, which walks similar code for
the reuse fingerprint) because capture sits below parallel/ and must not import it.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import torch

__all__ = ["reads_training"]

_MAX_FUNCTIONS = 5000
_ATTRIBUTE = "training"


class _Unknown(Exception):
    """Code the scan cannot read: assume it reads the mode."""


def _code_reads(code: types.CodeType) -> bool:
    if _ATTRIBUTE in code.co_names or _ATTRIBUTE in code.co_consts:
        return True
    return any(isinstance(c, types.CodeType) and _code_reads(c) for c in code.co_consts)


def _names(code: types.CodeType) -> set[str]:
    out = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out |= _names(const)
    return out


class _Scan:
    def __init__(self) -> None:
        self.seen: set[int] = set()

    def function(self, fn: Any) -> bool:
        fn = inspect.unwrap(fn)
        code = getattr(fn, "__code__", None)
        if code is None:
            return False  # builtins and C functions take the mode as an argument, never read it
        if id(code) in self.seen:
            return False
        self.seen.add(id(code))
        if len(self.seen) > _MAX_FUNCTIONS:
            raise _Unknown
        if _code_reads(code):
            return True
        glb = getattr(fn, "__globals__", {})
        for name in _names(code):
            value = glb.get(name)
            if isinstance(value, types.FunctionType) and self.function(value):
                return True
        return False

    def klass(self, cls: type) -> bool:
        for base in cls.__mro__:
            if base in (torch.nn.Module, object):
                continue
            for member in vars(base).values():
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if isinstance(member, property):
                    member = member.fget
                if isinstance(member, types.FunctionType) and self.function(member):
                    return True
        return False


def _hook_reads(scan: _Scan, hook: Any) -> bool:
    fn = hook if hasattr(hook, "__code__") else vars(type(hook)).get("__call__")
    if not hasattr(fn, "__code__"):
        return True  # a partial or a C callable: cannot tell
    return scan.function(fn)


def reads_training(module: torch.nn.Module) -> bool:
    """True unless no code the module's forward can run reads a `training` attribute."""
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    scan = _Scan()
    try:
        classes = {type(m) for m in module.modules()}
        if any(scan.klass(cls) for cls in classes):
            return True
        hooks = [
            h for m in module.modules() for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())
        ]
        return any(_hook_reads(scan, h) for h in hooks)
    except _Unknown:
        return True
