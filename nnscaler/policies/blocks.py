"""Find fused projections: an output later cut into k equal chunks along its last dim (q, k, v)."""

from __future__ import annotations

from nnscaler.graph.ir import Graph

__all__ = ["blocks_hint"]

_CHUNKERS = {"aten.split.Tensor", "aten.chunk.default"}
_SAME_LAST_DIM = {
    "aten.view.default",
    "aten.reshape.default",
    "aten._unsafe_view.default",
    "aten.contiguous.default",
    "aten.to.dtype",
    "aten.clone.default",
    "aten.alias.default",
}


def blocks_hint(graph: Graph, value: str, depth: int = 4) -> int:
    """How many equal blocks the last dim of `value` is cut into downstream (1 if none)."""
    meta = graph.values[value].meta
    if meta is None or not meta.shape or depth == 0:
        return 1
    last = meta.shape[-1]
    for node in _consumers(graph, value):
        if node.op in _CHUNKERS:
            dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
            outs = [graph.values[o].meta for o in node.outputs]
            if dim % len(meta.shape) == len(meta.shape) - 1 and len({o.shape[-1] for o in outs}) == 1:
                if outs[0].shape[-1] * len(outs) == last:
                    return len(outs)
        elif node.op in _SAME_LAST_DIM:
            out = graph.values[node.outputs[0]].meta
            if out is not None and out.shape and out.shape[-1] == last:
                hint = blocks_hint(graph, node.outputs[0], depth - 1)
                if hint > 1:
                    return hint
    return 1


def _consumers(graph: Graph, value: str):
    index = getattr(graph, "_consumer_index", None)
    if index is None or index[0] != len(graph.nodes):
        index = (len(graph.nodes), graph.consumers())
        graph._consumer_index = index  # cache for repeated look-ups during one policy run
    return index[1].get(value, [])
