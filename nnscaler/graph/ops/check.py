"""The op of a value check that only raises (graph/capture/value_checks.py), and rules for the
reductions such checks are written with (`labels.max()`, `x.min()`).

A check's condition is checked element by element, so it splits like the tensor it reads: a
condition on a computed tensor is made element-wise (graph/capture/local_checks.py) and each rank
checks the elements it holds; a 0-d condition (on the forward's inputs, whole on every rank) is
checked whole. Data-parallel replicas each check their own batch.
"""

from __future__ import annotations

from nnscaler.graph.ops._letters import letters
from nnscaler.graph.ops.elementwise import elementwise
from nnscaler.graph.ops.reduce import non_additive
from nnscaler.graph.ops.registry import OpCall, OpRule, register_rule, rule

__all__ = ["VALUE_CHECK_OP", "is_value_check"]

VALUE_CHECK_OP = "nnscaler_check.value_check.default"
"""`value_check(Tensor cond, bool raise_when, str exc, str message, str where) -> Tensor`: raises
`exc(message)` when an element of `cond` equals `raise_when` (`cond.any()` / `not cond.all()`);
returns the condition (so it has an output to annotate)."""


def is_value_check(op: str) -> bool:
    """Whether the op is a value check traced as an assumption."""
    return op == VALUE_CHECK_OP


@rule(VALUE_CHECK_OP, "check")
def value_check(call: OpCall) -> str:
    """Element by element (graph/capture/local_checks.py): each rank checks the elements it holds."""
    dims = " ".join(letters(len(call.inputs[0].shape)))
    return f"{dims} -> {dims}"


# what checks are written with: `x.max()` / `x.min()` / `.all()` / `.any()` over every element (a max
# over split pieces is not a sum: reduced dims stay whole, `^`), and `torch.isfinite(x)`
for _op in ("aten.max.default", "aten.min.default", "aten.all.default", "aten.any.default"):
    register_rule(OpRule(_op, non_additive, "reduce"))
register_rule(OpRule("aten.isfinite.default", elementwise, "elementwise"))
