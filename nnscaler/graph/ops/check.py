"""The op of a value check that only raises (graph/capture/value_checks.py), and rules for the
reductions such checks are written with (`labels.max()`, `x.min()`).

A check's condition is a 0-d tensor: it is read whole (replicated), never split. Its inputs come from
the ranks' own values (a graph input is whole on every rank of a plan; data parallel replicas each
check their own batch), so each rank checks the values it sees and raises itself.
"""

from __future__ import annotations

from nnscaler.graph.ops.elementwise import elementwise
from nnscaler.graph.ops.reduce import non_additive
from nnscaler.graph.ops.registry import OpRule, fixed, register_rule

__all__ = ["VALUE_CHECK_OP", "is_value_check"]

VALUE_CHECK_OP = "nnscaler_check.value_check.default"
"""`value_check(Tensor cond, bool raise_when, str exc, str message, str where) -> Tensor`: raises
`exc(message)` when `bool(cond) == raise_when`; returns the condition (so it has an output to annotate)."""


def is_value_check(op: str) -> bool:
    """Whether the op is a value check traced as an assumption."""
    return op == VALUE_CHECK_OP


fixed(VALUE_CHECK_OP, "check", " -> ")

# what checks are written with: `x.max()` / `x.min()` / `.all()` / `.any()` over every element (a max
# over split pieces is not a sum: reduced dims stay whole, `^`), and `torch.isfinite(x)`
for _op in ("aten.max.default", "aten.min.default", "aten.all.default", "aten.any.default"):
    register_rule(OpRule(_op, non_additive, "reduce"))
register_rule(OpRule("aten.isfinite.default", elementwise, "elementwise"))
