"""CTC loss (`F.ctc_loss`, traced as one op by graph/capture/ctc_loss.py): split by the batch.

With lengths given as tensors and targets padded to (batch, longest), each sample's loss depends
only on its own rows, so the batch splits: the loss per sample ('none') follows it, a sum or a mean
over the batch ('sum', 'mean': each sample's loss divided by its target length, then averaged) is a
partial result. Concatenated 1-D targets and lengths given as Python lists keep every dim whole.
"""

from __future__ import annotations

from nnscaler.graph.ops._letters import letters
from nnscaler.graph.ops.registry import OpCall, rule

__all__ = ["ctc_loss"]

_NONE, _MEAN = 0, 1


def _reduction(call: OpCall) -> int:
    return call.arg(5, "reduction", _MEAN)


def _whole(call: OpCall) -> str:
    ins = [" ".join(i + "^" for i in letters(len(m.shape), 5 * k)) for k, m in enumerate(call.inputs)]
    out = call.outputs[0].shape
    return ", ".join(ins) + " -> " + " ".join(i + "^" for i in letters(len(out), 20))


@rule(["aten.ctc_loss.Tensor", "aten.ctc_loss.IntList"], "loss", mean_scale=lambda c: _reduction(c) == _MEAN)
def ctc_loss(call: OpCall) -> str:
    shapes = [m.shape for m in call.inputs]
    batched = call.node.op == "aten.ctc_loss.Tensor" and len(shapes) == 4 and len(shapes[0]) == 3
    if not batched or len(shapes[1]) != 2:
        return _whole(call)
    if _reduction(call) == _NONE:
        return "t^ n c^, n s^, n, n -> n"
    return "t^ n+ c^, n+ s^, n+, n+ -> "
