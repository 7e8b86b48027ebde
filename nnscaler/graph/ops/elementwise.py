"""Elementwise ops (with broadcasting), casts and activations: every dim splits the same way."""

from __future__ import annotations

from nnscaler.graph.ops._letters import broadcast_inputs, letters
from nnscaler.graph.ops.registry import OpCall, rule

UNARY_AND_BINARY = [
    "aten.add.Tensor",
    "aten.sub.Tensor",
    "aten.mul.Tensor",
    "aten.div.Tensor",
    "aten.div.Tensor_mode",
    "aten.add.Scalar",
    "aten.sub.Scalar",
    "aten.mul.Scalar",
    "aten.div.Scalar",
    "aten.rsub.Scalar",
    "aten.rsub.Tensor",
    "aten.pow.Tensor_Scalar",
    "aten.pow.Tensor_Tensor",
    "aten.pow.Scalar",
    "aten.rsqrt.default",
    "aten.sqrt.default",
    "aten.exp.default",
    "aten.log.default",
    "aten.neg.default",
    "aten.abs.default",
    "aten.reciprocal.default",
    "aten.sin.default",
    "aten.cos.default",
    "aten.tanh.default",
    "aten.sigmoid.default",
    "aten.silu.default",
    "aten.gelu.default",
    "aten.relu.default",
    "aten.erf.default",
    "aten.softplus.default",
    "aten.leaky_relu.default",
    "aten.hardtanh.default",
    "aten.clamp.default",
    "aten.clamp.Tensor",
    "aten.clamp_min.default",
    "aten.clamp_max.default",
    "aten.minimum.default",
    "aten.maximum.default",
    "aten.where.self",
    "aten.where.ScalarOther",
    "aten.where.ScalarSelf",
    "aten.eq.Tensor",
    "aten.eq.Scalar",
    "aten.ne.Tensor",
    "aten.ne.Scalar",
    "aten.lt.Tensor",
    "aten.lt.Scalar",
    "aten.le.Tensor",
    "aten.le.Scalar",
    "aten.gt.Tensor",
    "aten.gt.Scalar",
    "aten.ge.Tensor",
    "aten.ge.Scalar",
    "aten.__and__.Tensor",
    "aten.__or__.Tensor",
    "aten.bitwise_and.Tensor",
    "aten.bitwise_or.Tensor",
    "aten.bitwise_not.default",
    "aten.logical_and.default",
    "aten.logical_or.default",
    "aten.logical_not.default",
    "aten.masked_fill.Scalar",
    "aten.masked_fill.Tensor",
    "aten.to.dtype",
    "aten.to.dtype_layout",
    "aten.to.device",
    "aten.to.other",
    "aten._to_copy.default",
    "aten.type_as.default",
    "aten.contiguous.default",
    "aten.clone.default",
    "aten.alias.default",
    "aten.detach.default",
    "aten.lift_fresh_copy.default",
    "aten.zeros_like.default",
    "aten.ones_like.default",
    "aten.full_like.default",
    "aten.empty_like.default",
    "aten.isnan.default",
    "aten.isinf.default",
    "aten.sign.default",
    "aten.floor.default",
    "aten.ceil.default",
    "aten.round.default",
    "aten.log1p.default",
    "aten.expm1.default",
    "aten.square.default",
    "aten.floor_divide.default",
    "aten.remainder.Scalar",
    "aten.remainder.Tensor",
    "aten.fmod.Scalar",
    "aten.lerp.Scalar",
    "aten.dropout.default",
    "aten.gelu_.default",
    "aten.relu_.default",
    "aten.silu_.default",
    "aten.add_.Tensor",
    "aten.sub_.Tensor",
    "aten.mul_.Tensor",
    "aten.div_.Tensor",
    "aten.add_.Scalar",
    "aten.mul_.Scalar",
    "aten.fill_.Scalar",
    "aten.clamp_.default",
    "aten.masked_fill_.Scalar",
]


_DTYPE_ONLY = {"aten.to.other", "aten.type_as.default"}
"""Ops whose second tensor gives only a dtype (and device), whatever its shape."""


def _broadcasts(shape: tuple[int, ...], out: tuple[int, ...]) -> bool:
    offset = len(out) - len(shape)
    return offset >= 0 and all(s in (1, out[i + offset]) for i, s in enumerate(shape))


@rule(UNARY_AND_BINARY, "elementwise")
def elementwise(call: OpCall) -> str:
    out = call.outputs[0].shape
    out_ids = letters(len(out))
    shapes = [m.shape for m in call.inputs]
    # a dtype-giving tensor of another shape (x.type_as(y)) is read whole: '?'
    whole = [k == 1 and call.node.op in _DTYPE_ONLY and not _broadcasts(s, out) for k, s in enumerate(shapes)]
    texts = iter(broadcast_inputs(out, [s for s, w in zip(shapes, whole) if not w], out_ids))
    return ", ".join("?" if w else next(texts) for w in whole) + " -> " + " ".join(out_ids)


@rule(
    [
        "aten.softmax.int",
        "aten._softmax.default",
        "aten.log_softmax.int",
        "aten._log_softmax.default",
        "aten.cumsum.default",
        "aten.cumprod.default",
    ],
    "elementwise",
)
def along_dim(call: OpCall) -> str:
    """Ops that mix values along one dim: that dim cannot be split."""
    shape = call.outputs[0].shape
    dim = call.arg(1, "dim") % max(len(shape), 1)
    ids = [("a" if False else x) for x in letters(len(shape))]
    ids = [x + ("^" if i == dim else "") for i, x in enumerate(ids)]
    return " ".join(ids) + " -> " + " ".join(ids)


@rule(["aten.triu.default", "aten.tril.default"], "elementwise")
def triangular(call: OpCall) -> str:
    shape = call.outputs[0].shape
    ids = letters(len(shape))
    ids = [x + ("^" if i >= len(shape) - 2 else "") for i, x in enumerate(ids)]
    return " ".join(ids) + " -> " + " ".join(ids)


@rule("aten.broadcast_tensors.default", "elementwise")
def broadcast_tensors(call: OpCall) -> str:
    out = call.outputs[0].shape
    out_ids = letters(len(out))
    ins = broadcast_inputs(out, [m.shape for m in call.inputs], out_ids)
    return ", ".join(ins) + " -> " + ", ".join(" ".join(out_ids) for _ in call.outputs)
