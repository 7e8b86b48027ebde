"""One forward and backward of a module for `verify`, leaving the module as it was.

Both runs (eager and generated) take fresh copies of the dummy inputs, start from the same RNG seed
(dropout draws the same masks when the ops run in the same order) inside `torch.random.fork_rng`
(the caller's random stream is untouched), and take gradients with `torch.autograd.grad` (no
parameter's `.grad` changes). Buffers (batch-norm statistics) and train/eval flags are put back.

The loss is the output when it is one scalar; otherwise a seeded random projection of every float
output (the same weights for both runs, drawn from the output shapes), so every output feeds the
gradients. Recording helpers (module boundaries, per-line values) are used only to localise a
difference once one is found.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

__all__ = [
    "RunResult",
    "Call",
    "ModuleRecorder",
    "LineRecorder",
    "preserved_state",
    "run_once",
    "fresh_inputs",
    "line_key",
]

_SEED = 1234


@dataclass
class RunResult:
    """Flat outputs (pytree leaves), their structure, and each parameter's gradient (None: no gradient)."""

    leaves: list[Any]
    spec: Any
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)


@contextlib.contextmanager
def preserved_state(module: torch.nn.Module) -> Iterator[None]:
    """Put back every buffer (object and values) and every train/eval flag of `module` on exit."""
    saved = []
    for sub in module.modules():
        buffers = dict(sub._buffers)
        values = {k: b.detach().clone() for k, b in buffers.items() if isinstance(b, torch.Tensor)}
        saved.append((sub, sub.training, buffers, values))
    try:
        yield
    finally:
        with torch.no_grad():
            for sub, training, buffers, values in saved:
                sub.training = training
                sub._buffers.clear()
                sub._buffers.update(buffers)
                for k, v in values.items():
                    buffers[k].copy_(v)


def fresh_inputs(kwargs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """A copy of the dummy inputs the run may change (in-place writes into inputs), grad flags kept,
    on the model's device (as capture traces them)."""

    def copy(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        c = v.detach().clone() if v.device == device else v.detach().to(device)
        return c.requires_grad_(v.requires_grad) if (c.is_floating_point() or c.is_complex()) else c

    return pytree.tree_map(copy, kwargs)


def _loss(leaves: list[Any]) -> torch.Tensor | None:
    floats = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if len(leaves) == 1 and floats and floats[0].numel() == 1:
        return floats[0].reshape(()) if floats[0].requires_grad else None
    gen = torch.Generator().manual_seed(_SEED)
    total = None
    for t in floats:  # a weight for every float output, so both runs draw the same ones
        w = torch.randn(t.shape, generator=gen, dtype=torch.float32).to(device=t.device, dtype=t.dtype)
        if t.requires_grad:
            term = (t * w).sum()
            total = term if total is None else total + term
    return total


def _rng_devices(device: torch.device) -> list[Any]:
    return [device] if device.type == "cuda" else []


def run_once(
    module: torch.nn.Module,
    kwargs: dict[str, Any],
    params: dict[str, torch.Tensor | None],
    device: torch.device,
    training: bool,
    backward: bool,
    watch: contextlib.AbstractContextManager | None = None,
) -> RunResult:
    """Forward (and backward) of `module` in train (or eval) mode on copies of `kwargs`; `params`:
    name -> tensor to differentiate; `watch`: a context the forward runs in (a LineRecorder)."""
    inputs = fresh_inputs(kwargs, device)
    with preserved_state(module), torch.random.fork_rng(_rng_devices(device)), torch.enable_grad():
        module.train(training)
        torch.manual_seed(_SEED)
        with watch or contextlib.nullcontext():
            out = module(**inputs)
        leaves, spec = pytree.tree_flatten(out)
        result = RunResult(leaves, spec)
        loss = _loss(leaves) if backward else None
        wanted = {k: p for k, p in params.items() if p is not None and p.requires_grad}
        result.grads = dict.fromkeys(params)
        if loss is not None and wanted:
            grads = torch.autograd.grad(loss, list(wanted.values()), allow_unused=True)
            result.grads.update(zip(wanted, grads))
    result.leaves = [t.detach() if isinstance(t, torch.Tensor) else t for t in leaves]
    return result


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t.detach().clone() for t in pytree.tree_leaves(obj) if isinstance(t, torch.Tensor)]


@dataclass
class _Seen:
    inputs: list[list[torch.Tensor]] = field(default_factory=list)
    outputs: list[list[torch.Tensor]] = field(default_factory=list)


class ModuleRecorder:
    """Forward hooks on every sub-module: the tensors each one received and returned, per call."""

    def __init__(self, module: torch.nn.Module):
        self.seen: dict[str, _Seen] = {}
        self.handles: list[Any] = []
        for path, sub in module.named_modules():
            seen = self.seen.setdefault(path, _Seen())
            self.handles.append(
                sub.register_forward_pre_hook(
                    lambda m, a, kw, s=seen: s.inputs.append(_tensors((a, kw))), with_kwargs=True
                )
            )
            self.handles.append(
                sub.register_forward_hook(lambda m, a, o, s=seen: s.outputs.append(_tensors(o)))
            )

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def line_key(source: str) -> str:
    """'file.py:52' of a node's source ('file.py:52  code')."""
    return source.split("  ", 1)[0]


_HERE = os.path.abspath(__file__)


def _user_line() -> tuple[str, str]:
    """('file.py:52', path) of the innermost frame outside torch (as capture names a node's source)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "/torch/" not in name and os.path.abspath(name) != _HERE:
            return f"{os.path.basename(name)}:{frame.f_lineno}", name
        frame = frame.f_back
    return "", ""


@dataclass
class Call:
    """One torch call eager made inside the watched module: its line, name and the tensors it gave."""

    line: str
    path: str
    name: str
    tensors: list[torch.Tensor]
    wrote: bool


class LineRecorder(TorchFunctionMode):
    """Records every torch call made while the module at `path` runs: (line, values), and in-place
    writes (`x[i] = v`, `x.add_(y)`) with the written tensor's value after the write."""

    def __init__(self, root: torch.nn.Module, path: str):
        super().__init__()
        self.calls: list[Call] = []
        self.active = 0
        watched = root.get_submodule(path)
        self.handles = [
            watched.register_forward_pre_hook(lambda *_: self._enter()),
            watched.register_forward_hook(lambda *_: self._leave(), always_call=True),
        ]

    def _enter(self) -> None:
        self.active += 1

    def _leave(self) -> None:
        self.active -= 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.active:
            name = getattr(func, "__name__", str(func))
            wrote = (
                name == "__setitem__" or (name.endswith("_") and not name.startswith("_")) or "out" in kwargs
            )
            tensors = _tensors(out)
            if wrote and args and isinstance(args[0], torch.Tensor):
                tensors = [args[0].detach().clone(), *tensors]
            if tensors:
                line, path = _user_line()
                self.calls.append(Call(line, path, name, tensors, wrote))
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()
