"""Matrix products: the ops tensor parallelism splits (column on n, row on the reduction dim k)."""

from __future__ import annotations

from nnscaler.graph.ops._letters import broadcast_inputs, letters
from nnscaler.graph.ops.registry import OpCall, fixed, rule


@rule("aten.linear.default", "linear", bias_input=2)
def linear(call: OpCall) -> str:
    if len(call.inputs) == 3:
        return "* k+, n k+, n -> * n"
    return "* k+, n k+ -> * n"


@rule("aten.addmm.default", "linear", bias_input=0)
def addmm(call: OpCall) -> str:
    """beta * bias + alpha * (m1 @ m2); the bias broadcasts to (m, n). Split on k, the partition adds the
    bias once after the reduction, unscaled, so k splits only where beta and alpha are 1."""
    (bias,) = broadcast_inputs(call.outputs[0].shape, [call.inputs[0].shape], ["m", "n"])
    k = "k+" if call.arg(3, "beta", 1) == 1 and call.arg(4, "alpha", 1) == 1 else "k^"
    return f"{bias}, m {k}, {k} n -> m n"


fixed("aten.mm.default", "linear", "m k+, k+ n -> m n")
fixed("aten.bmm.default", "linear", "b m k+, b k+ n -> b m n")


def _beta_is_one(call: OpCall) -> bool:
    """Split on the reduction, the bias is added once after it, unscaled (the local op runs with
    beta=0, alpha kept: see partition's bias split): exact only where beta is 1."""
    return call.arg(3, "beta", 1) == 1


@rule("aten.baddbmm.default", "linear", bias_input=0)
def baddbmm(call: OpCall) -> str:
    """beta * input + alpha * (b1 @ b2) per batch; the input broadcasts to (b, m, n) (ALiBi's bias)."""
    (bias,) = broadcast_inputs(call.outputs[0].shape, [call.inputs[0].shape], ["b", "m", "n"])
    k = "k+" if _beta_is_one(call) else "k^"
    return f"{bias}, b m {k}, b {k} n -> b m n"


@rule("aten.addbmm.default", "linear", bias_input=0)
def addbmm(call: OpCall) -> str:
    """beta * input + alpha * sum over the batch of b1 @ b2: the batch is a reduction like k."""
    (bias,) = broadcast_inputs(call.outputs[0].shape, [call.inputs[0].shape], ["m", "n"])
    b, k = ("b+", "k+") if _beta_is_one(call) else ("b^", "k^")
    return f"{bias}, {b} m {k}, {b} {k} n -> m n"


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
