"""Where an opaque leaf can start: the functions on a failing call stack, innermost first.

When torch.export fails on data-dependent Python, the smallest region that holds the failing line
runs eagerly as one op (leaf_modules.py). A region is a method of a module of the model (its key is
`model.get_image_features()`, or `scatter()` for a method of the top module) or a submodule's forward
(its key is the submodule's path). The top module's forward is never one: it is the whole model.
Plain functions (not methods) are skipped: the method that called them is the region.

Where a real run reads tensor values (`value_reads`) says which regions hold reads that a trace
would fail on later, so capture makes them leaves before tracing again.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from nnscaler.graph.capture.leaf_op import (
    method_key,
    split_key,
)

__all__ = [
    "VALUE_READS",
    "SIZE_READS",
    "stack_regions",
    "trace_regions",
    "value_reads",
    "failure_chain",
    "method_of",
    "owner_of",
]

_SKIP = ("/torch/", "/nnscaler/")


def _attributes(module: torch.nn.Module) -> list[dict[str, Any]]:
    """Where `module`'s attributes live, first found first: the instance, then its classes."""
    return [module.__dict__, *(vars(k) for k in type(module).__mro__)]


def method_of(module: torch.nn.Module, code: CodeType) -> str | None:
    """The name of `module`'s method (an attribute, decorators and all) whose own function is `code`
    (a decorator's wrapper, whose code many methods share, is none)."""
    owners = _attributes(module)
    for attr in dict.fromkeys([code.co_name, *(n for d in owners for n in d)]):  # its own name first
        fn = next((d[attr] for d in owners if attr in d), None)
        if (
            callable(fn)
            and not isinstance(fn, (staticmethod, classmethod, type))
            and _innermost_code(fn) is code
        ):
            return attr
    return None


def _region(path: str, module: torch.nn.Module, code: CodeType) -> str | None:
    name = method_of(module, code)
    if name is None or name.startswith("__"):
        return None
    if name == "forward":
        return path or None  # the top module's forward is the whole model
    return method_key(path, name)


def _frames(exc: BaseException) -> list[FrameType]:
    """The frames of `exc` and of the exceptions it came from, outermost first."""
    return [frame for cause in failure_chain(exc) for frame, _ in traceback.walk_tb(cause.__traceback__)]


def stack_regions(exc: BaseException, root: torch.nn.Module) -> list[str]:
    """Keys of the regions whose code is on the failing call stack, innermost first."""
    return _regions_of(_frames(exc), root)


def trace_regions(stack_trace: str, paths: list[str], root: torch.nn.Module) -> list[str]:
    """Keys of the regions around a traced node, innermost first, from its `stack_trace` (the user
    functions it was called from) and the module paths of its `nn_module_stack` (innermost first)."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\w+)', stack_trace or "")
    user = [(f, int(n), fn) for f, n, fn in frames if not any(s in f for s in _SKIP)][::-1]
    owners = [*paths, ""]
    found: list[str] = []
    for filename, line, fn in user:
        for path in owners:
            module = root.get_submodule(path) if path else root
            key = _named_region(path, module, fn, filename, line)
            if key is not None:
                if key not in found:
                    found.append(key)
                break
    for path in paths:  # a submodule's forward holds the node even where its frame was not named
        if path not in found:
            found.append(path)
    return found


def _named_region(path: str, module: torch.nn.Module, fn: str, filename: str, line: int) -> str | None:
    owners = _attributes(module)
    for attr in dict.fromkeys([fn, *(n for d in owners for n in d)]):
        code = _innermost_code(next((d[attr] for d in owners if attr in d), None))
        if (
            code is not None
            and code.co_name == fn
            and code.co_filename == filename
            and code.co_firstlineno <= line
        ):
            return _region(path, module, code)
    return None


def _innermost_code(fn: Any) -> CodeType | None:
    """The code of the function under `fn`'s decorators (their `__wrapped__` chain)."""
    if not callable(fn):
        return None
    code = None
    for _ in range(16):
        fn = getattr(fn, "__func__", fn)
        code = getattr(fn, "__code__", code)
        if getattr(fn, "__wrapped__", None) is None:
            return code
        fn = fn.__wrapped__
    return code


VALUE_READS = frozenset(
    {"tolist", "item", "__int__", "__float__", "__bool__", "__index__", "nonzero", "masked_select", "unique"}
)
"""Tensor methods and functions that read values (torch.export makes them unbacked symbols)."""
SIZE_READS = frozenset({"tolist", "__int__", "__index__", "nonzero", "masked_select", "unique"})
"""The reads that give sizes and loop counts, not truth values (`if x.max() >= n: raise` may be a value
check that traces, graph/capture/value_checks.py)."""


class _WatchReads(TorchFunctionMode):
    """Notes every read of tensor values (`reads`) with the regions around it and its source line."""

    def __init__(self, root: torch.nn.Module, reads: frozenset[str]):
        super().__init__()
        self.root, self.reads = root, reads
        self.paths = {id(m): p for p, m in root.named_modules()}
        self.known: dict[tuple[int, CodeType], str | None] = {}
        self.seen: list[tuple[list[str], str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: D105
        name = getattr(func, "__name__", "")
        if name in self.reads:
            frames = _caller_frames()
            regions = _regions_of(frames, self.root, self.paths, self.known)
            self.seen.append((regions, _user_line(frames), name))
        return func(*args, **(kwargs or {}))


def _caller_frames() -> list[FrameType]:
    frames, frame = [], sys._getframe(1)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames[::-1]


def _user_line(frames: list[FrameType]) -> str:
    for frame in reversed(frames):
        if not any(s in frame.f_code.co_filename for s in _SKIP):
            info = traceback.extract_stack(frame, limit=1)[-1]
            return f"{os.path.basename(info.filename)}:{info.lineno} `{(info.line or '').strip()}`"
    return "an unknown line"


def value_reads(root: torch.nn.Module, run: Callable[[], Any]) -> list[tuple[list[str], str, str]]:
    """Every read of tensor values (`VALUE_READS`) in `run()` (a real forward), in order: the regions
    around it (innermost first), its source line and the read (`tolist`, `__bool__`...). Empty when
    `run()` fails."""
    watch = _WatchReads(root, VALUE_READS)
    try:
        with watch:
            run()
    except Exception:  # noqa: BLE001 - the model fails eagerly: nothing to say here
        return []
    return watch.seen


def failure_chain(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions it came from, down to torch's own data-dependent failure (older ones it
    was raised while handling, e.g. an earlier trace's, say nothing about this one)."""
    chain: list[BaseException] = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    by_type = [i for i, e in enumerate(chain) if type(e).__name__ in _DATA_DEPENDENT]
    by_text = [i for i, e in enumerate(chain) if any(key in str(e) for key in _DATA_DEPENDENT)]
    last = (by_type or by_text or [len(chain) - 1])[-1]
    return chain[: last + 1]


_DATA_DEPENDENT = (
    "GuardOnDataDependentSymNode",
    "DataDependentOutputException",
    "DynamicOutputShapeException",
    "data-dependent",
    "data dependent",
)


def _regions_of(
    frames: list[FrameType],
    root: torch.nn.Module,
    paths: dict[int, str] | None = None,
    known: dict[tuple[int, CodeType], str | None] | None = None,
) -> list[str]:
    """The regions of `frames` (outermost first), innermost first. `paths` (id of a module -> its path)
    and `known` ((module id, code) -> region) save work when called for many stacks of one model."""
    paths = paths if paths is not None else {id(m): p for p, m in root.named_modules()}
    known = known if known is not None else {}
    found: list[str] = []
    for frame in frames:
        if any(s in frame.f_code.co_filename for s in _SKIP) or "self" not in frame.f_code.co_varnames:
            continue
        module = frame.f_locals.get("self")
        path = paths.get(id(module))
        if path is None:
            continue
        cache = (id(module), frame.f_code)
        if cache not in known:
            known[cache] = _region(path, module, frame.f_code)
        key = known[cache]
        if key is not None and key not in found:
            found.append(key)
    return found[::-1]


def owner_of(root: torch.nn.Module, key: str) -> torch.nn.Module:
    """The module a leaf key runs (a method's: the module that owns it)."""
    path = split_key(key)[0]
    return root.get_submodule(path) if path else root
