"""Ops that create tensors from sizes (arange, zeros, new_ones...): computed whole on every device."""

from __future__ import annotations

from nnscaler.graph.ops._letters import letters
from nnscaler.graph.ops.registry import OpCall, rule


@rule(
    [
        "aten.arange.default",
        "aten.arange.start",
        "aten.arange.start_step",
        "aten.zeros.default",
        "aten.ones.default",
        "aten.full.default",
        "aten.empty.memory_format",
        "aten.new_ones.default",
        "aten.new_zeros.default",
        "aten.new_full.default",
        "aten.new_empty.default",
        "aten.scalar_tensor.default",
        "aten.rand.default",
        "aten.randn.default",
        "aten.linspace.default",
    ],
    "creation",
)
def creation(call: OpCall) -> str:
    ins = ["?"] * len(call.inputs)
    out = " ".join(i + "^" for i in letters(len(call.outputs[0].shape)))
    return ", ".join(ins) + " -> " + out
