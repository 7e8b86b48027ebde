"""Ops whose readable form needs more than a table entry: argument reordering (embedding, batch norm),
defaults left out (attention, cross entropy), slices as subscripts, dtype conversions."""

from __future__ import annotations

import builtins
from collections.abc import Callable
from typing import Any

from nnscaler.graph.ops.check import VALUE_CHECK_OP
from nnscaler.partition import Statement

__all__ = ["SPECIAL", "call_code", "arg_at", "tensor_kwargs"]

_MAXINT = 9223372036854775807
_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}
_CHECK_ARGS = ("cond", "raise_when", "exc", "message", "where")

Render = Callable[[Statement, Any], str]
"""(statement, formatter) -> the expression; the formatter renders one argument value."""


def call_code(fn: str, args: list[str], kwargs: dict[str, str]) -> str:
    return f"{fn}(" + ", ".join(args + [f"{k}={v}" for k, v in kwargs.items()]) + ")"


def arg_at(s: Statement, i: int, name: str, default: Any = None) -> Any:
    return s.args[i] if i < len(s.args) else s.kwargs.get(name, default)


def tensor_kwargs(s: Statement, f, skip: tuple[str, ...] = ("layout", "pin_memory")) -> dict[str, str]:
    return {k: f(v) for k, v in s.kwargs.items() if k not in skip and v is not None}


def _slice(s: Statement, f) -> str:
    x, dim = f(s.args[0]), arg_at(s, 1, "dim", 0)
    start, end, step = arg_at(s, 2, "start", None), arg_at(s, 3, "end", None), arg_at(s, 4, "step", 1)
    part = ("" if start in (None, 0) else f(start)) + ":" + ("" if end in (None, _MAXINT) else f(end))
    if step not in (None, 1):
        part += f":{f(step)}"
    if dim < 0:
        return f"{x}[..., {part}" + ", :" * (-dim - 1) + "]"
    return f"{x}[" + ":, " * dim + part + "]"


def _reduce(method: str) -> Render:
    def fmt(s: Statement, f) -> str:
        args = [f(a) for a in s.args[1:]]
        return call_code(f"{f(s.args[0])}.{method}", args, tensor_kwargs(s, f))

    return fmt


def _new_tensor(method: str) -> Render:
    return lambda s, f: call_code(
        f"{f(s.args[0])}.{method}",
        [f(a) for a in s.args[1:]],
        tensor_kwargs(s, f, skip=("layout", "pin_memory", "device")),
    )


def _embedding(s: Statement, f) -> str:
    pad = arg_at(s, 2, "padding_idx", -1)
    return call_code("F.embedding", [f(s.args[1]), f(s.args[0])], {"padding_idx": f(pad)} if pad >= 0 else {})


def _layer_norm(s: Statement, f) -> str:
    return call_code("F.layer_norm", [f(a) for a in s.args[:5]], {})


def _sdpa(s: Statement, f) -> str:
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
    return call_code("F.scaled_dot_product_attention", [f(a) for a in s.args[:3]], kw)


def _cross_entropy(s: Statement, f) -> str:
    kw = {}
    weight = arg_at(s, 2, "weight")
    if weight is not None:
        kw["weight"] = f(weight)
    reduction = _REDUCTIONS[arg_at(s, 3, "reduction", 1)]
    if reduction != "mean":
        kw["reduction"] = repr(reduction)
    kw["ignore_index"] = f(arg_at(s, 4, "ignore_index", -100))
    if arg_at(s, 5, "label_smoothing", 0.0):
        kw["label_smoothing"] = f(arg_at(s, 5, "label_smoothing"))
    return call_code("F.cross_entropy", [f(s.args[0]), f(s.args[1])], kw)


def _batch_norm(s: Statement, f) -> str:
    names = ["input", "weight", "bias", "running_mean", "running_var"]
    x, w, b, rm, rv = (f(arg_at(s, i, n)) for i, n in enumerate(names))
    training, momentum, eps = (f(arg_at(s, i, n)) for i, n in [(5, "training"), (6, "momentum"), (7, "eps")])
    if f.sync_batch_norm and arg_at(s, 5, "training"):
        f.used_sync_norm = True
        return call_code("sync_norm.sync_batch_norm", [x, w, b, rm, rv, training, momentum, eps, "dp"], {})
    return call_code("F.batch_norm", [x, rm, rv, w, b, training, momentum, eps], {})


def _to(s: Statement, f) -> str:
    args = [f(a) for a in s.args[1:]]
    kw = tensor_kwargs(s, f, skip=("layout", "pin_memory", "device"))
    return call_code(f"{f(s.args[0])}.to", args, kw)


def _value_check(s: Statement, f) -> str:
    """`nnscaler.runtime.checks.raise_if(cond, ValueError, "message", "model.py:30  if ...")`: the
    model's check that only raises (graph/capture/value_checks.py), on this rank's values."""
    cond, raise_when, exc, message, where = (arg_at(s, i, n) for i, n in enumerate(_CHECK_ARGS))
    fn = "raise_if" if raise_when else "raise_unless"
    cls = exc if exc.isidentifier() and isinstance(getattr(builtins, exc, None), type) else repr(exc)
    return call_code(f"nnscaler.runtime.checks.{fn}", [f(cond), cls, f(message), f(where)], {})


def _split(s: Statement, f) -> str:
    kw = {"dim": f(arg_at(s, 2, "dim", 0))}
    return call_code(f"{f(s.args[0])}.split", [f(s.args[1])], kw)


SPECIAL: dict[str, Render] = {
    "aten.embedding.default": _embedding,
    "aten.batch_norm.default": _batch_norm,
    "aten.layer_norm.default": _layer_norm,
    "aten.scaled_dot_product_attention.default": _sdpa,
    "aten.cross_entropy_loss.default": _cross_entropy,
    "aten.to.dtype": _to,
    "aten.to.dtype_layout": _to,
    "aten.to.device": _to,
    "aten._to_copy.default": _to,
    "aten.split.Tensor": _split,
    "aten.slice.Tensor": _slice,
    "aten.alias.default": lambda s, f: f(s.args[0]),
    "aten.neg.default": lambda s, f: f"-{f(s.args[0])}",
    "aten.new_ones.default": _new_tensor("new_ones"),
    "aten.new_zeros.default": _new_tensor("new_zeros"),
    "aten.new_full.default": _new_tensor("new_full"),
    "aten.new_empty.default": _new_tensor("new_empty"),
    "aten.mean.dim": _reduce("mean"),
    "aten.mean.default": _reduce("mean"),
    "aten.sum.dim_IntList": _reduce("sum"),
    "aten.sum.default": _reduce("sum"),
    "aten.amax.default": _reduce("amax"),
    VALUE_CHECK_OP: _value_check,
}
"""aten op -> its renderer."""
