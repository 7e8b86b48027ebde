"""Which aten ops render as a tensor method, a binary operator, a torch function or a
torch.nn.functional call: plain tables, one entry per op overload."""

from __future__ import annotations

__all__ = ["METHOD", "BINARY", "TORCH_FN", "F_FN"]

# aten.view renders as `.reshape`: a view that held at capture can meet a tensor of other strides on a
# rank (an all-to-all's or a gather's output is contiguous where the traced value was a transposed
# view of a transposed layout, and capture drops the `.contiguous()` that was a no-op there);
# `reshape` is that same view whenever one exists and a copy otherwise.
METHOD = {  # aten op -> tensor method taking the remaining positional args
    "aten.view.default": "reshape",
    "aten.reshape.default": "reshape",
    "aten._unsafe_view.default": "reshape",
    "aten.transpose.int": "transpose",
    "aten.permute.default": "permute",
    "aten.unsqueeze.default": "unsqueeze",
    "aten.squeeze.dim": "squeeze",
    "aten.squeeze.dims": "squeeze",
    "aten.expand.default": "expand",
    "aten.contiguous.default": "contiguous",
    "aten.flatten.using_ints": "flatten",
    "aten.t.default": "t",
    "aten.unflatten.int": "unflatten",
    "aten.chunk.default": "chunk",
    "aten.type_as.default": "type_as",
    "aten.view_as.default": "view_as",
    "aten.expand_as.default": "expand_as",
    "aten.clone.default": "clone",
    "aten.lift_fresh_copy.default": "clone",  # a constant made in forward (torch.tensor(...))
    "aten.detach.default": "detach",
    "aten.masked_fill.Scalar": "masked_fill",
    "aten.masked_fill.Tensor": "masked_fill",
    "aten.max.default": "max",  # over every element (a value check's `labels.max()`)
    "aten.min.default": "min",
    "aten.all.default": "all",
    "aten.any.default": "any",
}
BINARY = {
    "aten.add.Tensor": "+",
    "aten.sub.Tensor": "-",
    "aten.mul.Tensor": "*",
    "aten.div.Tensor": "/",
    "aten.pow.Tensor_Scalar": "**",
    "aten.pow.Tensor_Tensor": "**",
    "aten.__and__.Tensor": "&",
    "aten.__or__.Tensor": "|",
    "aten.eq.Tensor": "==",
    "aten.eq.Scalar": "==",
    "aten.ne.Tensor": "!=",
    "aten.ne.Scalar": "!=",
    "aten.lt.Tensor": "<",
    "aten.lt.Scalar": "<",
    "aten.le.Tensor": "<=",
    "aten.le.Scalar": "<=",
    "aten.gt.Tensor": ">",
    "aten.gt.Scalar": ">",
    "aten.ge.Tensor": ">=",
    "aten.ge.Scalar": ">=",
    "aten.add.Scalar": "+",
    "aten.sub.Scalar": "-",
    "aten.mul.Scalar": "*",
    "aten.div.Scalar": "/",
}
TORCH_FN = {
    "aten.rsqrt.default": "torch.rsqrt",
    "aten.isfinite.default": "torch.isfinite",
    "aten.sqrt.default": "torch.sqrt",
    "aten.exp.default": "torch.exp",
    "aten.log.default": "torch.log",
    "aten.tanh.default": "torch.tanh",
    "aten.sigmoid.default": "torch.sigmoid",
    "aten.sin.default": "torch.sin",
    "aten.cos.default": "torch.cos",
    "aten.abs.default": "torch.abs",
    "aten.cat.default": "torch.cat",
    "aten.stack.default": "torch.stack",
    "aten.where.self": "torch.where",
    "aten.arange.default": "torch.arange",
    "aten.arange.start": "torch.arange",
    "aten.arange.start_step": "torch.arange",
    "aten.zeros.default": "torch.zeros",
    "aten.ones.default": "torch.ones",
    "aten.full.default": "torch.full",
    "aten.addmm.default": "torch.addmm",
    "aten.mm.default": "torch.mm",
    "aten.bmm.default": "torch.bmm",
    "aten.matmul.default": "torch.matmul",
    "aten.cumsum.default": "torch.cumsum",
    "aten.erf.default": "torch.erf",
    "aten.triu.default": "torch.triu",
    "aten.tril.default": "torch.tril",
    "aten.minimum.default": "torch.minimum",
    "aten.maximum.default": "torch.maximum",
    "aten.softmax.int": "torch.softmax",
    "aten.log_softmax.int": "torch.log_softmax",
    "aten.diff.default": "torch.diff",
}
F_FN = {
    "aten.silu.default": "F.silu",
    "aten.relu.default": "F.relu",
    "aten.gelu.default": "F.gelu",
    "aten.dropout.default": "F.dropout",
    "aten.linear.default": "F.linear",
    "aten.pad.default": "F.pad",
}
