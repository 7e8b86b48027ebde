"""Find fused projections: an output later cut into k equal chunks along its last dim (q, k, v), or
reshaped so that its last dim becomes several (heads, q/k/v, head size)."""

from __future__ import annotations

from nnscaler.graph.ir import Graph, graph_fact

__all__ = ["blocks_hint", "sub_dims"]

_CHUNKERS = {"aten.split.Tensor", "aten.chunk.default"}
_TRANSPOSES = {"aten.transpose.int", "aten.permute.default", "aten.t.default"}
_RESHAPES = {"aten.view.default", "aten.reshape.default", "aten._unsafe_view.default", "aten.unflatten.int"}
_SAME_LAST_DIM = {
    "aten.view.default",
    "aten.reshape.default",
    "aten._unsafe_view.default",
    "aten.contiguous.default",
    "aten.to.dtype",
    "aten.clone.default",
    "aten.alias.default",
}


def blocks_hint(graph: Graph, value: str, depth: int = 4, dim: int = -1) -> int:
    """How many equal blocks dim `dim` (the last) of `value` is cut into downstream (1 if none), also
    after transposes (Mamba: `in_proj(x).transpose(1, 2).chunk(2, dim=1)`)."""
    meta = graph.values[value].meta
    if meta is None or not meta.shape or depth == 0:
        return 1
    rank = len(meta.shape)
    d = dim % rank
    size = meta.shape[d]
    for node in _consumers(graph, value):
        hint = 1
        if node.op in _CHUNKERS:
            cut = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
            outs = [graph.values[o].meta for o in node.outputs]
            if (
                cut % rank == d
                and len({o.shape[d] for o in outs}) == 1
                and outs[0].shape[d] * len(outs) == size
            ):
                return len(outs)
        elif node.op in _TRANSPOSES:
            hint = blocks_hint(graph, node.outputs[0], depth - 1, _moved(node, d, rank))
        elif node.op in _SAME_LAST_DIM and d == rank - 1:
            out = graph.values[node.outputs[0]].meta
            if out is not None and out.shape and out.shape[-1] == size:
                hint = blocks_hint(graph, node.outputs[0], depth - 1)
        if hint > 1:
            return hint
    return 1


def _moved(node, d: int, rank: int) -> int:
    """Where dim `d` of a transpose's input is in its output."""
    if node.op == "aten.permute.default":
        return [p % rank for p in node.args[1]].index(d)
    if node.op == "aten.t.default":
        return rank - 1 - d
    a, b = node.args[1] % rank, node.args[2] % rank
    return b if d == a else a if d == b else d


def sub_dims(graph: Graph, value: str, depth: int = 4) -> list[int]:
    """The sizes the last dim of `value` is reshaped into downstream, outermost first (e.g. [3, 32] for
    nn.MultiheadAttention's packed q/k/v, [heads + 2, head size] for Falcon's multi-query q/k/v);
    [last dim] when no reshape splits it."""
    meta = graph.values[value].meta
    if meta is None or not meta.shape:
        return []
    lead, last = tuple(meta.shape[:-1]), meta.shape[-1]
    for node in _consumers(graph, value) if depth else []:
        out = graph.values[node.outputs[0]].meta
        if out is None or not out.shape:
            continue
        if node.op in _RESHAPES and tuple(out.shape[: len(lead)]) == lead and len(out.shape) > len(lead) + 1:
            tail = list(out.shape[len(lead) :])
            if _product(tail) == last and 1 not in tail:
                return tail
        elif node.op in _SAME_LAST_DIM and out.shape[-1] == last:
            found = sub_dims(graph, node.outputs[0], depth - 1)
            if len(found) > 1:
                return found
    return [last]


def _product(sizes: list[int]) -> int:
    out = 1
    for s in sizes:
        out *= s
    return out


def _consumers(graph: Graph, value: str):
    """The nodes that read `value` (the consumer map is built once per graph: look-ups repeat)."""
    return graph_fact(graph, "consumers", Graph.consumers).get(value, [])
