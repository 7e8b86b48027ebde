"""Convolutions, pooling and batch norm: split the batch or the channels; spatial dims stay whole."""

from __future__ import annotations

from nnscaler.graph.ir import Ref
from nnscaler.graph.ops._letters import letters
from nnscaler.graph.ops.registry import OpCall, rule


def _spatial(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}^" for i in range(n)]


@rule(
    [
        "aten.conv1d.default",
        "aten.conv2d.default",
        "aten.conv3d.default",
        "aten.conv1d.padding",
        "aten.conv2d.padding",
        "aten.conv3d.padding",
    ],
    "conv",
)
def conv(call: OpCall) -> str:
    x, w = call.inputs[0].shape, call.inputs[1].shape
    nsp = len(w) - 2
    batched = len(x) == nsp + 2
    groups = call.arg(6, "groups", 1)
    has_bias = len(call.inputs) > 2
    # without a bias the input channels are a reduction dim (partial sums); with one, kept whole
    c = "c^" if groups != 1 or has_bias else "c+"
    o = "o^" if groups != 1 else "o"
    n = "n " if batched else ""
    ins = [f"{n}{c} " + " ".join(_spatial("i", nsp)), f"{o} {c} " + " ".join(_spatial("k", nsp))]
    if has_bias:
        ins.append(o)
    return ", ".join(ins) + f" -> {n}{o} " + " ".join(_spatial("s", nsp))


@rule(
    [
        "aten.max_pool1d.default",
        "aten.max_pool2d.default",
        "aten.max_pool3d.default",
        "aten.avg_pool1d.default",
        "aten.avg_pool2d.default",
        "aten.avg_pool3d.default",
        "aten.adaptive_avg_pool1d.default",
        "aten.adaptive_avg_pool2d.default",
        "aten.adaptive_avg_pool3d.default",
        "aten.adaptive_max_pool2d.default",
    ],
    "conv",
)
def pool(call: OpCall) -> str:
    op = call.node.op
    nsp = 1 if "1d" in op else 3 if "3d" in op else 2
    x = call.inputs[0].shape
    lead = letters(len(x) - nsp)
    outs = [" ".join(lead + _spatial("s", nsp)) for _ in call.outputs]
    return " ".join(lead + _spatial("i", nsp)) + " -> " + ", ".join(outs)


@rule(["aten.batch_norm.default", "aten.instance_norm.default"], "norm")
def batch_norm(call: OpCall) -> str:
    """Per-channel statistics: channels split; the batch only outside training (stats span it)."""
    x = call.inputs[0].shape
    training = bool(
        call.arg(5, "training" if call.node.op == "aten.batch_norm.default" else "use_input_stats", True)
    )
    n = "n^" if training or call.node.op == "aten.instance_norm.default" else "n"
    rest = _spatial("s", len(x) - 2)
    ins = [" ".join([n, "c"] + rest)]
    ins += ["c" for a in call.args[1:5] if isinstance(a, Ref)]
    return ", ".join(ins) + " -> " + " ".join([n, "c"] + rest)


@rule("aten.group_norm.default", "norm")
def group_norm(call: OpCall) -> str:
    x = call.inputs[0].shape
    rest = _spatial("s", len(x) - 2)
    ins = [" ".join(["n", "c^"] + rest)] + ["c^"] * (len(call.inputs) - 1)
    return ", ".join(ins) + " -> " + " ".join(["n", "c^"] + rest)
