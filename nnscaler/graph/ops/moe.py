"""Mixture-of-experts kernels: grouped matmuls over tokens sorted by expert.

`grouped_mm(x [tokens, k], w [experts, k, n], offsets [experts])`: tokens stay whole (the offsets
index them); the experts' output features split (column-parallel) or their input features
(row-parallel, partial sums), as for a linear layer.
"""

from __future__ import annotations

from nnscaler.graph.ops.registry import OpCall, rule


@rule(["transformers.grouped_mm_fallback.default", "aten._grouped_mm.default"], "moe")
def grouped_mm(call: OpCall) -> str:
    ins = ["t^ k+", "e^ k+ n"] + ["e^"] * (len(call.inputs) - 2)
    return ", ".join(ins) + " -> t^ n"
