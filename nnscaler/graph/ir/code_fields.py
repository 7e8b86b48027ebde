"""Check the fields of a loaded graph that codegen writes into generated code as code.

Most text in a graph reaches gencode as data: state-dict names and messages become string literals,
source lines and module paths become escaped comments. A few fields are written as code, because
they are code: value names (local variables), forward argument names, op names (the function
called), dtype names, and the size expressions computed at run time (`x_size0 // 2`). A graph traced
by nnscaler only ever holds plain names and arithmetic there; a graph.json edited by hand, or
written by something else, might not. `check_code_fields` refuses such a graph before any code is
generated from it, naming the field.

This is a second line of defence: `parallelize(reuse='graph')` first checks graph.json against the
sha256 recorded when it was written (nnscaler.parallel.artifacts).
"""

from __future__ import annotations

import ast
import keyword
import re
from collections.abc import Iterator
from typing import Any

from nnscaler.graph.ir.graph import Graph, SymExpr, iter_refs
from nnscaler.graph.ir.mode import ModeValue

__all__ = ["check_code_fields", "UnsafeGraphError", "sym_codes"]

_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_KINDS = frozenset({"input", "param", "buffer", "activation"})
_SIZE_FUNCTIONS = frozenset({"min", "max", "abs", "int", "float", "bool", "round"})
_SIZE_NODES = (
    ast.Expression,
    ast.BinOp,
    ast.UnaryOp,
    ast.BoolOp,
    ast.Compare,
    ast.IfExp,
    ast.Name,
    ast.Load,
    ast.Constant,
    ast.Call,
    ast.Attribute,
    ast.operator,
    ast.unaryop,
    ast.boolop,
    ast.cmpop,
)


class UnsafeGraphError(ValueError):
    """A graph field that becomes code holds something that is not a plain name or size arithmetic."""


def _is_name(text: Any) -> bool:
    return isinstance(text, str) and text.isidentifier() and not keyword.iskeyword(text)


def _is_dotted(text: Any) -> bool:
    return isinstance(text, str) and _DOTTED.fullmatch(text) is not None


def _is_op(op: Any) -> bool:
    """'aten.add.Tensor', 'ns.op.default', or a custom autograd Function 'pkg.mod:Qual.Name.apply'."""
    if not isinstance(op, str):
        return False
    module, sep, rest = op.partition(":")
    return _is_dotted(module) and (not sep or (_is_dotted(rest) and rest.endswith(".apply")))


def _size_expression_problem(code: Any) -> str | None:
    """None when `code` is arithmetic over names (math.* and a few builtins called), else why not."""
    if not isinstance(code, str):
        return f"is a {type(code).__name__}, not an expression"
    try:
        tree = ast.parse(code, mode="eval")
    except SyntaxError:
        return "is not a Python expression"
    for node in ast.walk(tree):
        if not isinstance(node, _SIZE_NODES):
            return f"uses {type(node).__name__}, which size arithmetic never does"
        if isinstance(node, ast.Name) and node.id.startswith("__"):
            return f"names {node.id}"
        if isinstance(node, ast.Constant) and not isinstance(node.value, (int, float, bool)):
            return f"holds the constant {node.value!r}"
        if isinstance(node, ast.Attribute) and not (
            isinstance(node.value, ast.Name) and node.value.id == "math" and not node.attr.startswith("_")
        ):
            return "reads an attribute other than math.<function>"
        if isinstance(node, ast.Call):
            fn = node.func
            plain = isinstance(fn, ast.Name) and fn.id in _SIZE_FUNCTIONS
            if not (plain or isinstance(fn, ast.Attribute)) or node.keywords:
                return f"calls {ast.unparse(fn)}, not a math function"
    return None


def sym_codes(obj: Any) -> Iterator[str]:
    """The code of every SymExpr in a nested arg structure (ModeValues and containers walked)."""
    if isinstance(obj, SymExpr):
        yield obj.code
    elif isinstance(obj, ModeValue):
        yield from sym_codes(obj.train)
        yield from sym_codes(obj.eval)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from sym_codes(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from sym_codes(x)


def _kwarg_names(obj: Any) -> Iterator[Any]:
    if isinstance(obj, dict):
        yield from obj


def _problems(graph: Graph) -> Iterator[str]:
    import torch

    for key, v in graph.values.items():
        if not _is_name(v.name) or key != v.name:
            yield f"value name {v.name!r} is not a Python identifier"
        if v.kind not in _KINDS:
            yield f"value {v.name!r} has kind {v.kind!r}"
        if v.kind == "input" and v.target is not None and not _is_name(v.target):
            yield f"input {v.name!r} has forward argument name {v.target!r}"
        if v.meta is not None:
            if not isinstance(getattr(torch, str(v.meta.dtype), None), torch.dtype):
                yield f"value {v.name!r} has dtype {v.meta.dtype!r}, not a torch dtype"
            if not all(isinstance(s, int) for s in v.meta.shape):
                yield f"value {v.name!r} has shape {v.meta.shape!r}"
            for code in v.meta.sym or ():
                if code is not None and (why := _size_expression_problem(code)):
                    yield f"value {v.name!r} has a size expression {code!r} that {why}"
    for field, names in (
        ("forward_args", graph.forward_args),
        ("inputs", graph.inputs),
        ("input_leaves", [n for n in graph.input_leaves if n is not None]),
        ("size_names", list(graph.size_names)),
        ("untraced_args", list(graph.untraced_args)),
        ("outputs", [r.name for r in iter_refs(graph.outputs)]),
    ):
        for name in names:
            if not _is_name(name):
                yield f"{field} holds {name!r}, not a Python identifier"
    for key in graph.input_constants:
        if not (isinstance(key, str) and key.isdigit()):
            yield f"input_constants has key {key!r}, not a leaf index"
    for node in graph.nodes:
        if not _is_op(node.op):
            yield f"node {node.name!r} calls {node.op!r}, not an op name"
        for name in [*node.outputs, *node.input_names()]:
            if not _is_name(name):
                yield f"node {node.name!r} uses value {name!r}, not a Python identifier"
        for name in _kwarg_names(node.kwargs):
            if not _is_name(name):
                yield f"node {node.name!r} has keyword argument {name!r}, not a Python identifier"
        for code in sym_codes((node.args, node.kwargs)):
            if why := _size_expression_problem(code):
                yield f"node {node.name!r} has a size expression {code!r} that {why}"
    for rule in graph.shape_rules:
        if why := _size_expression_problem(rule.code):
            yield f"shape rule {rule.code!r} {why}"
    for code in sym_codes(graph.outputs):
        if why := _size_expression_problem(code):
            yield f"an output size expression {code!r} {why}"
    for type_name in _spec_types(graph.out_spec):
        if not _is_dotted(type_name):
            yield f"out_spec names the type {type_name!r}, not a dotted name"


def _spec_types(out_spec: str) -> Iterator[str]:
    """Type names in a pytree treespec dump (codegen imports their modules)."""
    import json

    if not out_spec:
        return
    try:
        spec = json.loads(out_spec)
    except ValueError:
        yield out_spec
        return
    stack = [spec[1] if isinstance(spec, list) and len(spec) > 1 else spec]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") is not None:
                yield node["type"]
            stack.extend(node.get("children_spec") or [])


def check_code_fields(graph: Graph, where: str = "the graph") -> None:
    """Raise UnsafeGraphError (naming the field) if a field codegen writes as code is not plain."""
    problems = list(dict.fromkeys(_problems(graph)))
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise UnsafeGraphError(
            f"{where} cannot be used to generate code: {'; '.join(problems[:5])}{more}. A graph traced by "
            "nnscaler holds only plain names and size arithmetic there; this one was edited or written "
            "by something else. Trace the model again (parallelize with reuse='moo' or 'override')"
        )
