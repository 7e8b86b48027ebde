"""Losses: split the batch (partial sums over the batch) or the classes (vocab-parallel cross entropy)."""

from __future__ import annotations

from nnscaler.graph.ops._letters import letters
from nnscaler.graph.ops.registry import OpCall, Special, fixed, rule

_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


@rule(
    "aten.cross_entropy_loss.default",
    "loss",
    specials={
        "n": Special("batch_parallel_cross_entropy"),
        "c": Special("vocab_parallel_cross_entropy", output="replicate"),
    },
)
def cross_entropy(call: OpCall) -> str:
    x, t = call.inputs[0].shape, call.inputs[1].shape
    reduction = _REDUCTIONS[call.arg(3, "reduction", 1)]
    weighted = len(call.inputs) > 2
    if len(x) != 2 or len(t) != 1 or weighted or call.arg(5, "label_smoothing", 0.0):
        ins = [" ".join(i + "^" for i in letters(len(m.shape), 5 * k)) for k, m in enumerate(call.inputs)]
        out = call.outputs[0].shape
        return ", ".join(ins) + " -> " + " ".join(i + "^" for i in letters(len(out), 20))
    if reduction == "none":
        return "n c^, n -> n"
    return "n+ c+, n+ -> "


@rule("aten.mse_loss.default", "loss", mean_scale=lambda call: call.arg(2, "reduction", 1) == 1)
def mse(call: OpCall) -> str:
    shape = call.inputs[0].shape
    reduction = _REDUCTIONS[call.arg(2, "reduction", 1)]
    ids = letters(len(shape))
    if reduction == "none":
        return f"{' '.join(ids)}, {' '.join(ids)} -> {' '.join(ids)}"
    flagged = " ".join(i + "+" for i in ids)
    return f"{flagged}, {flagged} -> "


# nnscaler.runtime.chunked_loss: per-token losses of hidden @ weight.T without whole logits; split on
# the tokens as is, on the vocabulary (the weight's rows, reduced over like embedding's) by the
# vocab-parallel chunked kernel, whose result is whole on every rank
fixed(
    "nnscaler.chunk_linear_cross_entropy.default",
    "loss",
    "n k^, v+ k^, n -> n",
    specials={"v": Special("vocab_parallel_chunk_linear_cross_entropy", output="replicate")},
)
