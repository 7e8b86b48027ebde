"""Reductions: reduced dims are '+' for sums and means (partial results), '^' for max/min."""

from __future__ import annotations

from nnscaler.graph.ops._letters import letters
from nnscaler.graph.ops.registry import OpCall, rule


def _reduce(call: OpCall, flag: str) -> str:
    shape = call.inputs[0].shape
    ids = letters(len(shape))
    dims = call.arg(1, "dim")
    if dims is None or dims == []:
        reduced = set(range(len(shape)))
    else:
        dims = [dims] if isinstance(dims, int) else dims
        reduced = {d % len(shape) for d in dims}
    keepdim = bool(call.arg(2, "keepdim", False))
    ins = [x + (flag if i in reduced else "") for i, x in enumerate(ids)]
    outs = [("1" if i in reduced else x) for i, x in enumerate(ids) if keepdim or i not in reduced]
    return " ".join(ins) + " -> " + " ".join(outs)


@rule(["aten.sum.dim_IntList", "aten.sum.default"], "reduce")
def sum_(call: OpCall) -> str:
    return _reduce(call, "+")


@rule(["aten.mean.dim", "aten.mean.default"], "reduce", mean_scale=True)
def mean(call: OpCall) -> str:
    return _reduce(call, "+")


@rule(
    [
        "aten.amax.default",
        "aten.amin.default",
        "aten.var.correction",
        "aten.std.correction",
        "aten.any.dim",
        "aten.all.dim",
        "aten.argmax.default",
        "aten.argmin.default",
        "aten.prod.dim_int",
    ],
    "reduce",
)
def non_additive(call: OpCall) -> str:
    return _reduce(call, "^")
