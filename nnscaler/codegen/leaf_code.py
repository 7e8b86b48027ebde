"""Code for opaque leaves (graph/capture/leaf_modules.py): one eager call of the module or method each.

A leaf node's args are its tensor inputs, then its parameters and buffers; its kwargs say how the
module was called (`in_spec`: the pytree of (args, kwargs), `constants`: the non-tensor leaves).
The line calls it as the model did, e.g.

    call_0, call_1 = nnscaler.runtime.leaf.call(self, "model.visual", pixel_values, grid_thw=image_grid_thw)

and the runtime runs the module on this module's own parameters and buffers (found by their original
names, so they need not be passed).
"""

from __future__ import annotations

import keyword
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.utils import _pytree as pytree

from nnscaler.codegen.safe_text import literal
from nnscaler.errors import CodegenError
from nnscaler.graph.ops.leaf import is_leaf_op
from nnscaler.partition import PipelineProgram, Program, Statement

__all__ = ["leaf_call_code", "leaf_module_lines"]

_RUNTIME = "nnscaler.runtime.leaf"


@dataclass(frozen=True)
class _Code:
    text: str


def _render(obj: Any) -> str:
    if isinstance(obj, _Code):
        return obj.text
    if isinstance(obj, tuple):
        return "(" + ", ".join(_render(x) for x in obj) + ("," if len(obj) == 1 else "") + ")"
    if isinstance(obj, list):
        return "[" + ", ".join(_render(x) for x in obj) + "]"
    if isinstance(obj, dict):
        return "{" + ", ".join(f"{literal(str(k))}: {_render(v)}" for k, v in obj.items()) + "}"
    raise CodegenError(
        f"an opaque leaf module's call holds a {type(obj).__name__}, which codegen cannot write"
    )


def _children(spec: pytree.TreeSpec) -> list[pytree.TreeSpec]:
    if hasattr(spec, "child"):  # torch 2.13; `children_specs` before
        return [spec.child(i) for i in range(spec.num_children)]
    return list(spec.children_specs)


def _check_containers(spec: pytree.TreeSpec, path: str) -> None:
    if spec.is_leaf():
        return
    if spec.type not in (tuple, list, dict):
        raise CodegenError(
            f"opaque leaf module {path} was traced with a {spec.type.__name__} argument; its call can hold "
            "only tuples, lists and dicts of tensors and literals (trace the model again)"
        )
    for child in _children(spec):
        _check_containers(child, path)


def leaf_call_code(s: Statement, f: Callable[[Any], str]) -> str:
    """`nnscaler.runtime.leaf.call(self, "<path>", <the module's arguments>)`."""
    path, ninputs = s.kwargs["leaf"], s.kwargs["inputs"]
    spec = pytree.treespec_loads(s.kwargs["in_spec"])
    _check_containers(spec, path)
    constants = s.kwargs["constants"]
    tensors = iter(s.args[:ninputs])
    leaves = [
        _Code(f(constants[str(i)]) if str(i) in constants else f(next(tensors)))
        for i in range(spec.num_leaves)
    ]
    args, kwargs = pytree.tree_unflatten(leaves, spec)
    parts = [_render(a) for a in args]
    named = {
        k: v
        for k, v in kwargs.items()
        if isinstance(k, str) and k.isidentifier() and not keyword.iskeyword(k)
    }
    parts += [f"{k}={_render(v)}" for k, v in named.items()]
    others = {k: v for k, v in kwargs.items() if k not in named}
    if others:
        parts.append(f"**{_render(others)}")
    return f"{_RUNTIME}.call(" + ", ".join(["self", literal(path), *parts]) + ")"


def _statements(program: Program | PipelineProgram) -> list[Statement]:
    if isinstance(program, PipelineProgram):
        return [st for stage in program.stages for st in stage.program.statements]
    return list(program.statements)


def leaf_module_lines(program: Program | PipelineProgram) -> tuple[list[str], list[str]]:
    """(imports, class attribute lines) for the leaf modules the program calls; ([], []) for none."""
    leaves = [st for st in _statements(program) if st.kind == "op" and is_leaf_op(st.op)]
    paths = sorted({st.kwargs["leaf"] for st in leaves})
    if not paths:
        return [], []
    attrs = [
        f"leaf_modules = {tuple(paths)!r}  # run eagerly, replicated, as one op each "
        "(nnscaler.runtime.leaf; parallelize attaches them)"
    ]
    used: dict[str, set[str]] = {}
    for st in leaves:
        if st.kwargs["leaf"].endswith("()"):  # a method: the state of its module it uses, by name there
            used.setdefault(st.kwargs["leaf"], set()).update(st.kwargs["state"])
    if used:  # one name a line (the class attribute lines are indented by 4)
        lines = [
            "leaf_state = {  # the parameters and buffers each opaque method uses, by name in its module"
        ]
        for key, names in sorted(used.items()):
            lines += [f"        {key!r}: (", *(f"            {n!r}," for n in sorted(names)), "        ),"]
        attrs.append("\n".join([*lines, "    }"]))
    return [f"{_RUNTIME}  # runs the opaque leaf modules"], attrs
