"""The captured program as one device runs it: single-device code from the real codegen, run in-process.

`verify` checks capture by running the graph through the same partition and codegen a compile uses
(the `dp` plan over one device), not through a separate interpreter: a wrong op rendering, a lost
ModeValue or a custom op called the wrong way is caught as well. The generated source is changed in
two ways only, both in `forward`: its `del` statements go (so every value is still there at the end)
and each `return` first hands `locals()` to a recorder, keyed by the graph's value names.

The generated module is a ParallelModule for rank 0 of 1. It is built without torch.distributed, even
where a process group exists (rank 0 of a multi-rank `parallelize`): construction is told there is none
(groups of one rank are `None` either way) and its pre-forward checks and gradient reducer are
removed, so it runs like a plain nn.Module on the user's module's device.
"""

from __future__ import annotations

import ast
import contextlib
import types
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch

import nnscaler.runtime.module as runtime_module
from nnscaler.codegen import generate_code
from nnscaler.config import ComputeConfig
from nnscaler.graph.ir import Graph
from nnscaler.partition.apply_plan import apply_plan
from nnscaler.policies import make_plan
from nnscaler.runtime.leaf import attach_leaf_modules
from nnscaler.version import __version__

__all__ = ["SingleDevice", "single_device_source", "build_single_device"]

_RECORD = "__nnscaler_verify_record__"


def single_device_source(graph: Graph) -> str:
    """gencode0.py of `graph` under the `dp` policy on one device (same shapes mode as the compile)."""
    cfg = ComputeConfig(1, 1, constant_folding=graph.static_shapes)
    program = apply_plan(graph, make_plan(graph, "dp", cfg))
    full_shapes = {k: v.meta.shape for k, v in graph.values.items() if v.meta is not None}
    # every layer inline: the recorded locals of forward must hold every value of the graph
    return generate_code(
        program, 0, cfg, graph.module_class, "dp", full_shapes, __version__, layer_functions=False
    )


class _KeepValues(ast.NodeTransformer):
    """In GenModel.forward: drop `del name` statements and record `locals()` before each return."""

    def visit_Delete(self, node: ast.Delete) -> Any:
        return None if all(isinstance(t, ast.Name) for t in node.targets) else node

    def visit_Return(self, node: ast.Return) -> Any:
        call = ast.Call(ast.Name(_RECORD, ast.Load()), [ast.Call(ast.Name("locals", ast.Load()), [], [])], [])
        return [ast.Expr(call), node]


def _instrument(source: str) -> ast.Module:
    tree = ast.parse(source)
    for cls in tree.body:
        if isinstance(cls, ast.ClassDef) and cls.name == "GenModel":
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "forward":
                    _KeepValues().visit(fn)
    return ast.fix_missing_locations(tree)


@contextlib.contextmanager
def _standalone(device: torch.device) -> Iterator[None]:
    """Build a one-device ParallelModule with no process group, its tensors on `device`."""
    with (
        mock.patch.object(runtime_module, "is_initialized", lambda: False),
        mock.patch.object(runtime_module, "runtime_device", lambda: device),
    ):
        yield


def _share(gen: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Give the generated module the model's own tensors (no copy of the weights): parameters as new
    Parameters over the same storage (keeping the generated requires_grad), buffers as the same
    storage (the runs put their values back). A tensor of another shape or dtype is copied instead."""
    names: dict[str, list[str]] = {}
    for alias, original in gen.aliases.items():
        names.setdefault(original, []).append(alias)
    with torch.no_grad():
        for local, info in gen.fullmap.items():
            key = next(
                (n for n in (info.original_name, *names.get(info.original_name, ())) if n in state), None
            )
            if key is None:
                continue
            src = state[key].detach()
            if tuple(src.shape) != info.full_shape or src.dtype != info.dtype:
                gen.load_merged_state_dict({info.original_name: src.to(info.dtype)}, strict=False)
            elif info.is_param:
                gen._parameters[local] = torch.nn.Parameter(
                    src, requires_grad=gen._parameters[local].requires_grad
                )
            else:
                gen._buffers[local] = src.to(gen._buffers[local].device)


class _Recorder:
    """Receives `locals()` at the end of a recorded forward (kept apart from SingleDevice: no cycle
    through the generated module, so its weights go as soon as the check is done)."""

    def __init__(self) -> None:
        self.on = False
        self.values: dict[str, Any] = {}

    def __call__(self, values: dict[str, Any]) -> None:
        if self.on:
            self.values = {k: v for k, v in values.items() if k != "self"}


class SingleDevice:
    """The generated single-device module, and the values of its last recorded forward."""

    def __init__(self, source: str, state: dict[str, torch.Tensor], device: torch.device):
        self.source = source
        self.recorder = _Recorder()
        namespace = types.ModuleType("nnscaler_verify_gencode")
        namespace.__dict__[_RECORD] = self.recorder
        exec(compile(_instrument(source), "<nnscaler verify: gencode0.py>", "exec"), namespace.__dict__)
        gen_class = namespace.GenModel
        gen_class.constants_file = None  # the constants come with `state`
        with _standalone(device):
            module = gen_class(init_params=False)
        module._forward_pre_hooks.clear()  # process-group checks, reducer: not for a one-device run
        module._forward_hooks.clear()
        _share(module, state)
        self.module = module
        self.params = {
            info.original_name: getattr(module, info.local_name)
            for info in module.fullmap.values()
            if info.is_param
        }
        self.aliases = dict(module.aliases)

    @property
    def values(self) -> dict[str, Any]:
        return self.recorder.values

    def param(self, name: str) -> torch.Tensor | None:
        """The module's parameter `name` (an original state-dict name, or a tied alias of one)."""
        return self.params.get(name, self.params.get(self.aliases.get(name, ""), None))


def build_single_device(
    graph: Graph, module: torch.nn.Module, constants: dict[str, torch.Tensor], device: torch.device
) -> SingleDevice:
    """The generated one-device module of `graph`, sharing `module`'s weights and buffers."""
    state: dict[str, torch.Tensor] = {}
    for name, t in (
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ):
        state[name] = t.detach()
    state.update(constants)
    single = SingleDevice(single_device_source(graph), state, device)
    attach_leaf_modules(single.module, module)  # opaque leaf modules run the model's own code
    return single
