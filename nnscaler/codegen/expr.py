"""Turn one partition Statement into a line of readable PyTorch (torch.nn.functional where it exists)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from nnscaler.codegen.leaf_code import leaf_call_code
from nnscaler.graph.ir import ModeValue, Ref, SymExpr, mesh_coords
from nnscaler.graph.ops.custom import op_emitter
from nnscaler.graph.ops.leaf import is_leaf_op
from nnscaler.partition import GROUP, AxisGroup, RankScaled, Statement

__all__ = ["Formatter", "statement_code"]

_MAXINT = 9223372036854775807
_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


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
    ):
        self.tp_index = tp_index
        self.mesh = mesh
        """The tensor-parallel group as a mesh (2-D splits); () when every split spans the group."""
        self.rank, self.plan_ngpus, self.runtime_ngpus = rank, plan_ngpus, runtime_ngpus
        """The global rank and device counts the code is for (register_op's emit_fn gets them)."""
        self.param_names = param_names
        self.sync_batch_norm = sync_batch_norm
        """Batch norm statistics span the data-parallel replicas (runtime_ngpus > plan_ngpus)."""
        self.used_sync_norm = False

    def __call__(self, obj: Any) -> str:
        if isinstance(obj, Ref):
            return f"self.{obj.name}" if obj.name in self.param_names else obj.name
        if obj is GROUP:
            return "tp"
        if isinstance(obj, AxisGroup):
            return f"tp_axis{obj.axis}"
        if isinstance(obj, RankScaled):
            index = self.tp_index if obj.axis is None else mesh_coords(self.tp_index, self.mesh)[obj.axis]
            return str(index * obj.scale)
        if isinstance(obj, SymExpr):  # a size computed from the input shapes at run time
            return obj.code
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


def _call(fn: str, args: list[str], kwargs: dict[str, str]) -> str:
    return f"{fn}(" + ", ".join(args + [f"{k}={v}" for k, v in kwargs.items()]) + ")"


def _arg(s: Statement, i: int, name: str, default: Any = None) -> Any:
    return s.args[i] if i < len(s.args) else s.kwargs.get(name, default)


def _slice(s: Statement, f: Formatter) -> str:
    x, dim = f(s.args[0]), _arg(s, 1, "dim", 0)
    start, end, step = _arg(s, 2, "start", None), _arg(s, 3, "end", None), _arg(s, 4, "step", 1)
    part = ("" if start in (None, 0) else f(start)) + ":" + ("" if end in (None, _MAXINT) else f(end))
    if step not in (None, 1):
        part += f":{f(step)}"
    if dim < 0:
        return f"{x}[..., {part}" + ", :" * (-dim - 1) + "]"
    return f"{x}[" + ":, " * dim + part + "]"


def _tensor_kwargs(
    s: Statement, f: Formatter, skip: tuple[str, ...] = ("layout", "pin_memory")
) -> dict[str, str]:
    return {k: f(v) for k, v in s.kwargs.items() if k not in skip and v is not None}


_METHOD = {  # aten op -> tensor method taking the remaining positional args
    "aten.view.default": "view",
    "aten.reshape.default": "reshape",
    "aten._unsafe_view.default": "view",
    "aten.transpose.int": "transpose",
    "aten.permute.default": "permute",
    "aten.unsqueeze.default": "unsqueeze",
    "aten.squeeze.dim": "squeeze",
    "aten.squeeze.dims": "squeeze",
    "aten.expand.default": "expand",
    "aten.contiguous.default": "contiguous",
    "aten.flatten.using_ints": "flatten",
    "aten.t.default": "t",
    "aten.unflatten.int": "unflatten",
    "aten.chunk.default": "chunk",
    "aten.type_as.default": "type_as",
    "aten.view_as.default": "view_as",
    "aten.expand_as.default": "expand_as",
    "aten.clone.default": "clone",
    "aten.lift_fresh_copy.default": "clone",  # a constant made in forward (torch.tensor(...))
    "aten.detach.default": "detach",
    "aten.masked_fill.Scalar": "masked_fill",
    "aten.masked_fill.Tensor": "masked_fill",
}
_BINARY = {
    "aten.add.Tensor": "+",
    "aten.sub.Tensor": "-",
    "aten.mul.Tensor": "*",
    "aten.div.Tensor": "/",
    "aten.pow.Tensor_Scalar": "**",
    "aten.pow.Tensor_Tensor": "**",
    "aten.__and__.Tensor": "&",
    "aten.__or__.Tensor": "|",
    "aten.eq.Tensor": "==",
    "aten.eq.Scalar": "==",
    "aten.ne.Tensor": "!=",
    "aten.ne.Scalar": "!=",
    "aten.lt.Tensor": "<",
    "aten.lt.Scalar": "<",
    "aten.le.Tensor": "<=",
    "aten.le.Scalar": "<=",
    "aten.gt.Tensor": ">",
    "aten.gt.Scalar": ">",
    "aten.ge.Tensor": ">=",
    "aten.ge.Scalar": ">=",
    "aten.add.Scalar": "+",
    "aten.sub.Scalar": "-",
    "aten.mul.Scalar": "*",
    "aten.div.Scalar": "/",
}
_TORCH_FN = {
    "aten.rsqrt.default": "torch.rsqrt",
    "aten.sqrt.default": "torch.sqrt",
    "aten.exp.default": "torch.exp",
    "aten.log.default": "torch.log",
    "aten.tanh.default": "torch.tanh",
    "aten.sigmoid.default": "torch.sigmoid",
    "aten.sin.default": "torch.sin",
    "aten.cos.default": "torch.cos",
    "aten.abs.default": "torch.abs",
    "aten.cat.default": "torch.cat",
    "aten.stack.default": "torch.stack",
    "aten.where.self": "torch.where",
    "aten.arange.default": "torch.arange",
    "aten.arange.start": "torch.arange",
    "aten.arange.start_step": "torch.arange",
    "aten.zeros.default": "torch.zeros",
    "aten.ones.default": "torch.ones",
    "aten.full.default": "torch.full",
    "aten.addmm.default": "torch.addmm",
    "aten.mm.default": "torch.mm",
    "aten.bmm.default": "torch.bmm",
    "aten.matmul.default": "torch.matmul",
    "aten.cumsum.default": "torch.cumsum",
    "aten.erf.default": "torch.erf",
    "aten.triu.default": "torch.triu",
    "aten.tril.default": "torch.tril",
    "aten.minimum.default": "torch.minimum",
    "aten.maximum.default": "torch.maximum",
    "aten.softmax.int": "torch.softmax",
    "aten.log_softmax.int": "torch.log_softmax",
    "aten.diff.default": "torch.diff",
}
_F_FN = {
    "aten.silu.default": "F.silu",
    "aten.relu.default": "F.relu",
    "aten.gelu.default": "F.gelu",
    "aten.dropout.default": "F.dropout",
    "aten.linear.default": "F.linear",
    "aten.pad.default": "F.pad",
}


def _reduce(method: str) -> Callable[[Statement, Formatter], str]:
    def fmt(s: Statement, f: Formatter) -> str:
        args = [f(a) for a in s.args[1:]]
        return _call(f"{f(s.args[0])}.{method}", args, _tensor_kwargs(s, f))

    return fmt


def _special_ops() -> dict[str, Callable[[Statement, Formatter], str]]:
    def embedding(s, f):
        pad = _arg(s, 2, "padding_idx", -1)
        return _call("F.embedding", [f(s.args[1]), f(s.args[0])], {"padding_idx": f(pad)} if pad >= 0 else {})

    def layer_norm(s, f):
        args = [f(a) for a in s.args[:5]]
        return _call("F.layer_norm", args, {})

    def sdpa(s, f):
        names = ["attn_mask", "dropout_p", "is_causal"]
        kw = {n: f(a) for n, a in zip(names, s.args[3:])}
        kw.update({k: f(v) for k, v in s.kwargs.items()})
        kw = {
            k: v
            for k, v in kw.items()
            if not (k == "attn_mask" and v == "None")
            and not (k == "dropout_p" and v == "0.0")
            and not (k in ("is_causal", "enable_gqa") and v == "False")
        }
        return _call("F.scaled_dot_product_attention", [f(a) for a in s.args[:3]], kw)

    def cross_entropy(s, f):
        kw = {}
        weight = _arg(s, 2, "weight")
        if weight is not None:
            kw["weight"] = f(weight)
        reduction = _REDUCTIONS[_arg(s, 3, "reduction", 1)]
        if reduction != "mean":
            kw["reduction"] = repr(reduction)
        kw["ignore_index"] = f(_arg(s, 4, "ignore_index", -100))
        if _arg(s, 5, "label_smoothing", 0.0):
            kw["label_smoothing"] = f(_arg(s, 5, "label_smoothing"))
        return _call("F.cross_entropy", [f(s.args[0]), f(s.args[1])], kw)

    def batch_norm(s, f):
        x, w, b, rm, rv = (
            f(_arg(s, i, n)) for i, n in enumerate(["input", "weight", "bias", "running_mean", "running_var"])
        )
        training, momentum, eps = (
            f(_arg(s, i, n)) for i, n in [(5, "training"), (6, "momentum"), (7, "eps")]
        )
        if f.sync_batch_norm and _arg(s, 5, "training"):
            f.used_sync_norm = True
            return _call("sync_norm.sync_batch_norm", [x, w, b, rm, rv, training, momentum, eps, "dp"], {})
        return _call("F.batch_norm", [x, rm, rv, w, b, training, momentum, eps], {})

    def to(s, f):
        args = [f(a) for a in s.args[1:]]
        kw = _tensor_kwargs(s, f, skip=("layout", "pin_memory", "device"))
        return _call(f"{f(s.args[0])}.to", args, kw)

    def split(s, f):
        kw = {"dim": f(_arg(s, 2, "dim", 0))}
        return _call(f"{f(s.args[0])}.split", [f(s.args[1])], kw)

    def new_tensor(method):
        return lambda s, f: _call(
            f"{f(s.args[0])}.{method}",
            [f(a) for a in s.args[1:]],
            _tensor_kwargs(s, f, skip=("layout", "pin_memory", "device")),
        )

    return {
        "aten.embedding.default": embedding,
        "aten.batch_norm.default": batch_norm,
        "aten.layer_norm.default": layer_norm,
        "aten.scaled_dot_product_attention.default": sdpa,
        "aten.cross_entropy_loss.default": cross_entropy,
        "aten.to.dtype": to,
        "aten.to.dtype_layout": to,
        "aten.to.device": to,
        "aten._to_copy.default": to,
        "aten.split.Tensor": split,
        "aten.slice.Tensor": _slice,
        "aten.alias.default": lambda s, f: f(s.args[0]),
        "aten.neg.default": lambda s, f: f"-{f(s.args[0])}",
        "aten.new_ones.default": new_tensor("new_ones"),
        "aten.new_zeros.default": new_tensor("new_zeros"),
        "aten.new_full.default": new_tensor("new_full"),
        "aten.new_empty.default": new_tensor("new_empty"),
        "aten.mean.dim": _reduce("mean"),
        "aten.mean.default": _reduce("mean"),
        "aten.sum.dim_IntList": _reduce("sum"),
        "aten.sum.default": _reduce("sum"),
        "aten.amax.default": _reduce("amax"),
    }


_SPECIAL = _special_ops()


def op_expression(s: Statement, f: Formatter) -> str:
    """The right-hand side for an 'op' statement."""
    op = s.op
    emit = op_emitter(op)
    if emit is not None:
        return _emitted(emit, s, f)
    if op in _SPECIAL:
        return _SPECIAL[op](s, f)
    if op in _BINARY and len(s.args) == 2 and not s.kwargs:
        return f"{f(s.args[0])} {_BINARY[op]} {f(s.args[1])}"
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
    node = EmitNode(s.op, f"torch.ops.{s.op}", tuple(s.outputs), s.module_path, s.source)
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


def _operand(code: str) -> str:
    """Parenthesise a rendered value used as an operand unless it is a plain name or number."""
    return code if code.replace("_", "").replace(".", "").isalnum() else f"({code})"


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
        lhs = ", ".join(s.outputs) + ("," if len(s.outputs) == 1 else "")
    elif not s.outputs:
        return rhs
    else:
        lhs = s.outputs[0]
    return f"{lhs} = {rhs}"
