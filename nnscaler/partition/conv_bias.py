"""A convolution split on its input channels, with a bias: the local op runs without the bias (partial
sums), the partition all-reduces them, then adds the bias once, viewed (-1, 1, ..) to broadcast over
the channel dim (see `_Partitioner._bias_split`)."""

from __future__ import annotations

from typing import Any

from nnscaler.graph.ir import Node, Ref, TensorMeta, map_refs
from nnscaler.partition.program import Statement

__all__ = ["conv_without_bias", "bias_view"]


def conv_without_bias(
    node: Node, rule, args: tuple, kwargs: dict[str, Any], bias: Ref, splits: dict[str, int]
) -> tuple[tuple, dict[str, Any]]:
    """The local conv's arguments: every argument kept (stride, padding, dilation, groups...), the bias
    None, the groups made local where they are split."""

    def drop(r: Ref) -> Ref | None:
        return None if r.name == bias.name else r

    args, kwargs = map_refs(tuple(args), drop), map_refs(dict(kwargs), drop)
    if rule.local_args is not None:
        args, kwargs = rule.local_args(tuple(args), dict(kwargs), splits)
    return tuple(args), kwargs


def bias_view(
    bias: Ref, bias_meta: TensorMeta, spatial_dims: int, out: str, common: dict
) -> tuple[Statement, TensorMeta]:
    """`out = bias.view(-1, 1, ..)` (one 1 per spatial dim) and its local meta."""
    shape = [-1] + [1] * spatial_dims
    common = {**common, "note": "the bias broadcast over the channel dim"}
    stmt = Statement("op", "aten.view.default", (bias, shape), {}, [out], **common)
    meta = TensorMeta((bias_meta.shape[0],) + (1,) * spatial_dims, bias_meta.dtype, bias_meta.requires_grad)
    return stmt, meta
