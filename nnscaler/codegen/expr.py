"""Turn one partition Statement into a line of readable PyTorch (torch.nn.functional where it exists)."""

from __future__ import annotations

import ast
import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from nnscaler.codegen.leaf_code import leaf_call_code
from nnscaler.codegen.op_tables import BINARY as _BINARY
from nnscaler.codegen.op_tables import F_FN as _F_FN
from nnscaler.codegen.op_tables import METHOD as _METHOD
from nnscaler.codegen.op_tables import TORCH_FN as _TORCH_FN
from nnscaler.codegen.special_ops import SPECIAL as _SPECIAL
from nnscaler.codegen.special_ops import call_code as _call
from nnscaler.codegen.special_ops import tensor_kwargs as _tensor_kwargs
from nnscaler.graph.ir import ModeValue, Ref, SymExpr, mesh_coords
from nnscaler.graph.ops.check import is_value_check
from nnscaler.graph.ops.custom import op_emitter
from nnscaler.graph.ops.leaf import is_leaf_op
from nnscaler.partition import GROUP, AxisGroup, RankScaled, Statement

__all__ = ["Formatter", "statement_code"]


class Formatter:
    """Renders argument values for one rank: Refs become local names, RankScaled becomes a number."""

    def __init__(
        self,
        tp_index: int,
        param_names: set[str],
        sync_batch_norm: bool = False,
        rank: int = 0,
        plan_ngpus: int = 1,
        runtime_ngpus: int = 1,
        mesh: tuple[int, ...] = (),
        fold_sizes: bool = False,
    ):
        self.tp_index = tp_index
        self.fold_sizes = fold_sizes
        """constant_folding=True: run-time sizes are written as their traced values (the generated
        forward fixes the input dims they read: codegen/shape_code.py folded_sizes)."""
        self.mesh = mesh
        """The tensor-parallel group as a mesh (2-D splits); () when every split spans the group."""
        self.rank, self.plan_ngpus, self.runtime_ngpus = rank, plan_ngpus, runtime_ngpus
        """The global rank and device counts the code is for (register_op's emit_fn gets them)."""
        self.param_names = param_names
        self.sync_batch_norm = sync_batch_norm
        """Batch norm statistics span the data-parallel replicas (runtime_ngpus > plan_ngpus)."""
        self.names: dict[str, str] = {}
        """Value name -> the code to write for it instead (a layer function's locals and weights)."""
        self._used = {"sync_norm": False}  # shared with the renamed copies

    @property
    def used_sync_norm(self) -> bool:
        return self._used["sync_norm"]

    @used_sync_norm.setter
    def used_sync_norm(self, value: bool) -> None:
        self._used["sync_norm"] = value

    def renamed(self, names: dict[str, str]) -> Formatter:
        """This formatter, writing `names[v]` for each value v that `names` holds."""
        other = copy.copy(self)
        other.names = names
        return other

    def local(self, name: str) -> str:
        """The name a statement's output is bound to."""
        return self.names.get(name, name)

    def __call__(self, obj: Any) -> str:
        if isinstance(obj, Ref):
            if obj.name in self.names:
                return self.names[obj.name]
            return f"self.{obj.name}" if obj.name in self.param_names else obj.name
        if obj is GROUP:
            return "tp"
        if isinstance(obj, AxisGroup):
            return f"tp_axis{obj.axis}"
        if isinstance(obj, RankScaled):
            index = self.tp_index if obj.axis is None else mesh_coords(self.tp_index, self.mesh)[obj.axis]
            return str(index * obj.scale)
        if isinstance(obj, SymExpr):  # a size computed from the input shapes at run time
            return self(obj.hint) if self.fold_sizes else obj.code
        if isinstance(obj, ModeValue):  # follows the generated module's train()/eval()
            return obj.render(self)
        if isinstance(obj, bool) or obj is None:
            return repr(obj)
        if isinstance(obj, float):
            return repr(obj) if math.isfinite(obj) else f'float("{obj}")'
        if isinstance(obj, (int, str)):
            return repr(obj)
        if isinstance(obj, list):
            return "[" + ", ".join(self(x) for x in obj) + "]"
        if isinstance(obj, tuple):
            return "(" + ", ".join(self(x) for x in obj) + ("," if len(obj) == 1 else "") + ")"
        if isinstance(obj, torch.device):
            return "self.device"
        if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            return str(obj)
        raise TypeError(f"cannot render argument {obj!r}")


def op_expression(s: Statement, f: Formatter) -> str:
    """The right-hand side for an 'op' statement."""
    op = s.op
    emit = op_emitter(op)
    if emit is not None:
        return _emitted(emit, s, f)
    if op in _SPECIAL:
        return _SPECIAL[op](s, f)
    if op in _BINARY and len(s.args) == 2 and not s.kwargs:
        return f"{_operand(f(s.args[0]))} {_BINARY[op]} {_operand(f(s.args[1]))}"
    if op in _METHOD:
        return _call(f"{f(s.args[0])}.{_METHOD[op]}", [f(a) for a in s.args[1:]], _tensor_kwargs(s, f))
    if op in _TORCH_FN:
        return _call(_TORCH_FN[op], [f(a) for a in s.args], _tensor_kwargs(s, f))
    if op in _F_FN:
        return _call(_F_FN[op], [f(a) for a in s.args], _tensor_kwargs(s, f))
    if is_leaf_op(op):  # an opaque leaf module, run eagerly: `nnscaler.runtime.leaf.call(self, ...)`
        return leaf_call_code(s, f)
    if op.endswith(".apply") and ":" in op:  # a custom autograd Function: `module.Qualname.apply(...)`
        return _call(op.replace(":", "."), [f(a) for a in s.args], {k: f(v) for k, v in s.kwargs.items()})
    return _call(f"torch.ops.{op}", [f(a) for a in s.args], {k: f(v) for k, v in s.kwargs.items()})


@dataclass(frozen=True)
class EmitNode:
    """What register_op's emit_fn sees of the op it writes (nnScaler passes its IR node here)."""

    op: str
    signature: str
    """The default call target, e.g. 'torch.ops.nnscaler_user.ring_attn'."""
    outputs: tuple[str, ...]
    module_path: str
    source: str


def _emitted(emit: Callable, s: Statement, f: Formatter) -> str:
    node = EmitNode(s.op, f"torch.ops.{s.op}", tuple(f.local(o) for o in s.outputs), s.module_path, s.source)
    args = [f(a) for a in s.args]
    kwargs = {k: f(v) for k, v in s.kwargs.items()}
    code = emit(node, args, kwargs, f.rank, f.plan_ngpus, f.runtime_ngpus)
    if not isinstance(code, str) or not code.strip():
        raise TypeError(
            f"emit_fn registered for {s.op} returned {code!r}: it must return the call's Python code as a "
            f'string (e.g. "{node.signature}({", ".join(args)})")'
        )
    try:
        compile(code, "<emit_fn>", "eval")
    except SyntaxError as exc:
        raise SyntaxError(
            f"emit_fn registered for {s.op} returned code that is not an expression: {code!r}"
        ) from exc
    return code


_ATOMS = (ast.Name, ast.Constant, ast.Attribute, ast.Subscript, ast.Call, ast.List, ast.Tuple)


def _operand(code: str) -> str:
    """Parenthesise a rendered value used as an operand unless it is one atom (a name, a non-negative
    number, an attribute, a call): a run-time size such as `2*torch.sym_float(n)` under `/` must stay
    whole (`x / (2*n)`, not `x / 2*n`)."""
    try:
        node = ast.parse(code, mode="eval").body
    except SyntaxError:
        return f"({code})"
    return code if isinstance(node, _ATOMS) else f"({code})"


def statement_code(s: Statement, f: Formatter) -> str:
    """One assignment line for the statement."""
    if s.kind == "op":
        rhs = op_expression(s, f)
    elif s.kind in ("comm", "special"):
        rhs = _call(
            s.op if "." in s.op else f"comm.{s.op}",
            [f(a) for a in s.args],
            {k: f(v) for k, v in s.kwargs.items()},
        )
    elif s.kind == "scale":
        rhs = f"{f(s.args[0])} / {_operand(f(s.args[1]))}"
    elif s.kind == "bias":
        rhs = f"{f(s.args[0])} + {_operand(f(s.args[1]))}"
    else:
        raise ValueError(f"unknown statement kind {s.kind}")
    if s.tuple_output:
        lhs = ", ".join(f.local(o) for o in s.outputs) + ("," if len(s.outputs) == 1 else "")
    elif not s.outputs or (s.kind == "op" and is_value_check(s.op)):  # a check's result is never read
        return rhs
    else:
        lhs = f.local(s.outputs[0])
    return f"{lhs} = {rhs}"
