"""Op annotations: the language, the registry (one file per op family) and binding to traced shapes."""

from __future__ import annotations

from nnscaler.errors import TraceError
from nnscaler.graph.ir import Graph, Node, graph_fact
from nnscaler.graph.ops import (  # noqa: F401  (each module registers its family's rules)
    attention,
    conv,
    creation,
    einsum,
    elementwise,
    embedding,
    linear,
    loss,
    moe,
    norm,
    per_dim,
    products,
    reduce,
    scatter,
    view,
)
from nnscaler.graph.ops.annotation import AnnotationError, DimAnno, OpAnno, TensorAnno, parse_annotation
from nnscaler.graph.ops.bind import BoundAnno, bind_annotation
from nnscaler.graph.ops.custom import op_module, register_op
from nnscaler.graph.ops.registry import OpCall, OpRule, Special, all_rules, get_rule, op_call, register_rule
from nnscaler.graph.ops.split import (
    SplitLayouts,
    is_bias_split,
    layouts_for,
    mesh_layouts_for,
    split_candidates,
    split_layouts,
)

__all__ = [
    "register_op",
    "op_module",
    "AnnotationError",
    "DimAnno",
    "OpAnno",
    "TensorAnno",
    "parse_annotation",
    "BoundAnno",
    "bind_annotation",
    "OpCall",
    "OpRule",
    "Special",
    "all_rules",
    "get_rule",
    "op_call",
    "register_rule",
    "SplitLayouts",
    "split_candidates",
    "split_layouts",
    "annotate_node",
    "layouts_for",
    "mesh_layouts_for",
    "is_bias_split",
]


def annotate_node(node: Node, graph: Graph) -> BoundAnno | None:
    """The node's annotation bound to its traced shapes; None when the op has no rule. Once per node
    and rule of a graph (graph facts: a planner asks for the same node's annotation thousands of
    times, e.g. Llama-3-405B's offline plan 230,000 times)."""
    rule = get_rule(node.op)
    if rule is None:
        return None
    if not isinstance(graph, Graph):  # a graph being built (GraphBuilder) may still change
        return _annotate(node, graph, rule)
    bound = graph_fact(graph, "bound_annotations", lambda _: {})
    hit = bound.get(node.name)
    if hit is not None and hit[0] is node and hit[1] is rule:  # the same node object, the same rule
        return hit[2]
    out = _annotate(node, graph, rule)
    bound[node.name] = (node, rule, out)
    return out


def _annotate(node: Node, graph: Graph, rule: OpRule) -> BoundAnno:
    call = op_call(node, graph)
    try:
        result = rule.annotate(call)
        text, sizes = result if isinstance(result, tuple) else (result, None)
        return bind_annotation(
            parse_annotation(text),
            [m.shape for m in call.inputs],
            [m.shape if m is not None else None for m in call.outputs],
            sizes,
        )
    except (AnnotationError, KeyError, IndexError, TypeError) as exc:
        raise TraceError(
            f"annotation of {node.op} (node {node.name}, {node.source or 'unknown source'}) does not fit its "
            f"traced shapes: {exc}"
        ) from exc
