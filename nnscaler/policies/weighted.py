"""The ops tensor parallelism splits by their weights: linears, matmuls on a weight, grouped expert
matmuls and convolutions; which input is the activation, which the weight, and their identifiers."""

from __future__ import annotations

from dataclasses import dataclass

from nnscaler.graph.ir import Graph, Layout, Node, Ref, Shard, graph_fact, iter_refs
from nnscaler.graph.ops import annotate_node

__all__ = ["WeightedOp", "weighted_op", "derived_from", "tensor_refs", "node_index", "where"]

# op -> (input index of the activation, input index of the weight, reduction id, output id)
_WEIGHTED = {
    "aten.linear.default": (0, 1, "k", "n"),
    "aten.addmm.default": (1, 2, "k", "n"),
    "aten.mm.default": (0, 1, "k", "n"),
    "aten.matmul.default": (0, 1, "k", "n"),
    "transformers.grouped_mm_fallback.default": (0, 1, "k", "n"),
    "aten._grouped_mm.default": (0, 1, "k", "n"),
}
# convolutions (nnscaler/graph/ops/conv.py): channels 'c' in (a reduction; a bias is added once after
# it), 'o' out, channel-first
_CHANNEL_FIRST = {
    *(f"aten.conv{k}d.{v}" for k in (1, 2, 3) for v in ("default", "padding")),
    "aten.conv_transpose1d.default",
    "aten.conv_transpose2d.input",
    "aten.conv_transpose3d.input",
    "aten.convolution.default",
}
_WEIGHTED.update({op: (0, 1, "c", "o") for op in _CHANNEL_FIRST})


@dataclass(frozen=True)
class WeightedOp:
    """A node whose weight input is a parameter (or a view of one)."""

    node: Node
    x: str
    """The activation's value name."""
    weight: str
    weight_index: int
    """Position of the weight among the node's tensor inputs."""
    k: str
    """Annotation identifier of the reduction (input features / channels)."""
    n: str
    """Annotation identifier of the output features / channels."""
    k_dim: int
    """Dim of the activation carrying k."""
    channel_first: bool

    def reads_row_parallel(self, x_layout: Layout | None) -> bool:
        """Is the activation split on its reduction dim, so the op can run row-parallel?"""
        return isinstance(x_layout, Shard) and x_layout.dim == self.k_dim and x_layout.blocks == 1


def tensor_refs(graph: Graph, node: Node) -> list[Ref]:
    """The node's tensor inputs, in annotation order."""
    return [r for r in iter_refs((node.args, node.kwargs)) if graph.values[r.name].meta]


def derived_from(graph: Graph, value: str, kind: str, depth: int = 4) -> bool:
    """True when `value` is of `kind` ('input', 'param') or a chain of one-input ops (views, casts) on one."""
    v = graph.values[value]
    if v.kind == kind:
        return True
    if v.producer is None or depth == 0:
        return False
    node = node_index(graph)[v.producer]
    return len(node.input_names()) == 1 and derived_from(graph, node.input_names()[0], kind, depth - 1)


def _einsum_projection(graph: Graph, node: Node) -> WeightedOp | None:
    """An einsum of an activation and a weight (a parameter): a linear when every letter of the weight
    is either summed with the activation (input features, k: the outermost of them) or new in the
    output (output features, n: the outermost of them), e.g. "bsd,fd->bsf" or, by heads, "bsd,hde->bhse"
    (column-parallel on h) and "bhse,hed->bsd" (row-parallel on h)."""
    refs = tensor_refs(graph, node)
    if len(refs) != 2:
        return None
    is_param = [derived_from(graph, r.name, "param") for r in refs]
    if is_param.count(True) != 1:
        return None
    w_idx = is_param.index(True)
    bound = annotate_node(node, graph)
    x_anno, w_anno = bound.anno.inputs[1 - w_idx], bound.anno.inputs[w_idx]
    w_ids, x_ids, out_ids = w_anno.ids(), x_anno.ids(), bound.anno.outputs[0].ids()
    k = [i for i in w_ids if i in x_ids and bound.anno.flag_of(i) == "+"]
    n = [i for i in w_ids if i in out_ids and i not in x_ids and bound.anno.flag_of(i) == ""]
    if not k or not n or len(k) + len(n) != len(w_ids) or x_ids.count(k[0]) != 1:
        return None
    channel_first = out_ids[-1] != n[0]  # features not last: no blocks from a downstream reshape
    x = refs[1 - w_idx].name
    return WeightedOp(node, x, refs[w_idx].name, w_idx, k[0], n[0], x_ids.index(k[0]), channel_first)


def weighted_op(graph: Graph, node: Node) -> WeightedOp | None:
    """The node as a weighted op, or None (not such an op, or its weight is not a parameter)."""
    if node.op == "aten.einsum.default":
        return _einsum_projection(graph, node)
    spec = _WEIGHTED.get(node.op)
    if spec is None:
        return None
    x_idx, w_idx, k, n = spec
    refs = tensor_refs(graph, node)
    if len(refs) <= w_idx or not derived_from(graph, refs[w_idx].name, "param"):
        return None
    x = refs[x_idx].name
    channel_first = node.op in _CHANNEL_FIRST
    k_dim = 1 if channel_first else len(graph.values[x].meta.shape) - 1
    return WeightedOp(node, x, refs[w_idx].name, w_idx, k, n, k_dim, channel_first)


def node_index(graph: Graph) -> dict[str, Node]:
    """Node name -> node, built once per graph (the policy looks producers up often)."""
    return graph_fact(graph, "node_index", lambda g: {n.name: n for n in g.nodes})


def where(node: Node) -> str:
    """'op at file:line (module path)' for messages about a node."""
    line = node.source.split("  ", 1)[0] if node.source else "unknown source"
    module = f" ({node.module_path})" if node.module_path else ""
    return f"{node.op} at {line}{module}"
