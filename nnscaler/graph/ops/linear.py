"""Matrix products: the ops tensor parallelism splits (column on n, row on the reduction dim k)."""

from __future__ import annotations

from nnscaler.graph.ops._letters import letters
from nnscaler.graph.ops.registry import OpCall, fixed, rule


@rule("aten.linear.default", "linear", bias_input=2)
def linear(call: OpCall) -> str:
    if len(call.inputs) == 3:
        return "* k+, n k+, n -> * n"
    return "* k+, n k+ -> * n"


fixed("aten.addmm.default", "linear", "n, m k+, k+ n -> m n", bias_input=0)
fixed("aten.mm.default", "linear", "m k+, k+ n -> m n")
fixed("aten.bmm.default", "linear", "b m k+, b k+ n -> b m n")


@rule("aten.matmul.default", "linear")
def matmul(call: OpCall) -> str:
    a, b = (m.shape for m in call.inputs)
    if len(a) == 1 and len(b) == 1:
        return "k+, k+ -> "
    if len(b) == 1:
        return "* k+, k+ -> *"
    if len(a) == 1:
        return "k+, * k+ n -> * n"
    if len(b) == 2:
        return "* m k+, k+ n -> * m n"
    out = call.outputs[0].shape
    batch = letters(len(out) - 2, 4)

    def side(shape, tail):
        offset = len(out) - len(shape)
        ids = [
            ("1" if shape[i] == 1 and out[i + offset] != 1 else batch[i + offset])
            for i in range(len(shape) - 2)
        ]
        return " ".join(ids + tail)

    return f"{side(a, ['m', 'k+'])}, {side(b, ['k+', 'n'])} -> {' '.join(batch + ['m', 'n'])}"
