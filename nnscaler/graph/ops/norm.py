"""Normalisations: the normalised dims stay whole; leading (batch, sequence) dims split."""

from __future__ import annotations

from nnscaler.graph.ops._letters import letters
from nnscaler.graph.ops.registry import OpCall, rule


@rule(["aten.layer_norm.default", "aten.rms_norm.default"], "norm")
def layer_norm(call: OpCall) -> str:
    x = call.inputs[0].shape
    normalized = call.args[1]
    n = len(normalized)
    lead = letters(len(x) - n)
    norm_ids = [f"h{i}^" for i in range(n)]
    ins = [" ".join(lead + norm_ids)] + [" ".join(norm_ids)] * (len(call.inputs) - 1)
    return ", ".join(ins) + " -> " + " ".join(lead + norm_ids)
