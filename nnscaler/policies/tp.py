"""The `tp` policy: Megatron-style tensor parallelism, found by pattern rather than by search.

A weight-carrying linear (or grouped expert matmul, or convolution) whose input arrives sharded on
its reduction dim is row-parallel: partial sums, one all-reduce. Otherwise it is column-parallel
(output features split; fused q/k/v or gate/up weights split per block so each device keeps whole
heads) when its output can stay sharded up to a row-parallel consumer or the loss; else it is kept
whole. Token embeddings split the vocabulary, and a loss over vocab-sharded logits becomes
vocab-parallel cross entropy. Every other op follows its inputs (see propagate.py), so activation
functions and attention by heads run sharded with no communication between the column and the
row linear.
"""

from __future__ import annotations

from nnscaler.config import ComputeConfig
from nnscaler.graph.ir import Graph, Node, Shard, iter_refs
from nnscaler.graph.ops import BoundAnno, get_rule, split_layouts
from nnscaler.policies.blocks import blocks_hint
from nnscaler.policies.plan import NodePlan, Plan
from nnscaler.policies.propagate import PropagationState, propagate

__all__ = ["pas_tp"]

# op -> (input index of the activation, input index of the weight, reduction id, output id)
_WEIGHTED = {
    "aten.linear.default": (0, 1, "k", "n"),
    "aten.addmm.default": (1, 2, "k", "n"),
    "aten.mm.default": (0, 1, "k", "n"),
    "aten.matmul.default": (0, 1, "k", "n"),
    "transformers.grouped_mm_fallback.default": (0, 1, "k", "n"),
    "aten._grouped_mm.default": (0, 1, "k", "n"),
    "aten.conv1d.default": (0, 1, "c", "o"),
    "aten.conv2d.default": (0, 1, "c", "o"),
    "aten.conv3d.default": (0, 1, "c", "o"),
}
_CHANNEL_FIRST = {"aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default"}
_PASS_FAMILIES = {"elementwise", "attention", "user"}
_PASS_VIEW_RULES = {"reshape", "expand", "permute", "split", "slice_", "cat", "pool", "batch_norm"}
_STOP_OPS = {"aten.softmax.int", "aten._softmax.default", "aten.log_softmax.int", "aten.cumsum.default"}


def _derived_from(graph: Graph, value: str, kind: str, depth: int = 4) -> bool:
    """True when `value` is of `kind` ('input', 'param') or a chain of one-input ops (views, casts) on one."""
    v = graph.values[value]
    if v.kind == kind:
        return True
    if v.producer is None or depth == 0:
        return False
    node = graph.node(v.producer)
    return len(node.input_names()) == 1 and _derived_from(graph, node.input_names()[0], kind, depth - 1)


class _Lookahead:
    """Whether a column-split output can stay sharded until something that consumes it sharded."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.consumers = graph.consumers()
        self.outputs = set(graph.output_names())

    def reaches_consumer(self, value: str, limit: int = 64) -> bool:
        seen, frontier = set(), [value]
        while frontier and len(seen) < limit:
            name = frontier.pop()
            if name in seen:
                continue
            seen.add(name)
            if name in self.outputs:
                return True
            for node in self.consumers.get(name, []):
                rule = get_rule(node.op)
                if node.op in _WEIGHTED or (rule is not None and rule.family == "loss"):
                    return True
                passes = (
                    rule is not None
                    and node.op not in _STOP_OPS
                    and (rule.family in _PASS_FAMILIES or rule.annotate.__name__ in _PASS_VIEW_RULES)
                )
                if passes:
                    frontier.extend(node.outputs)
        return False


def pas_tp(graph: Graph, cfg: ComputeConfig) -> Plan:
    """Megatron-style tensor parallelism over the plan devices (see the module docstring)."""
    ways = cfg.plan_ngpus
    lookahead = _Lookahead(graph)

    def decide(state: PropagationState, node: Node, bound: BoundAnno) -> NodePlan | None:
        refs = [r for r in iter_refs((node.args, node.kwargs)) if graph.values[r.name].meta]
        if node.op in _WEIGHTED and len(refs) > _WEIGHTED[node.op][1]:
            return _weighted(state, node, bound, refs)
        if node.op == "aten.embedding.default" and graph.values[refs[0].name].kind == "param":
            if not _derived_from(graph, refs[1].name, "input"):  # token ids, not positions
                return NodePlan(note="indices are not token ids from the forward's inputs: kept whole")
            if not isinstance(split_layouts(bound, "v", ways), str):
                return NodePlan("v", ways, note="vocab-parallel")
            return NodePlan(note=f"vocabulary cannot be split {ways} ways: kept whole")
        return None

    def _weighted(state, node, bound, refs) -> NodePlan | None:
        x_idx, w_idx, k, n = _WEIGHTED[node.op]
        if not _derived_from(graph, refs[w_idx].name, "param"):  # e.g. transposed expert weights
            return None
        x_lay = state.layout(refs[x_idx].name)
        x_rank = len(graph.values[refs[x_idx].name].meta.shape)
        k_dim = 1 if node.op in _CHANNEL_FIRST else x_rank - 1
        if isinstance(x_lay, Shard) and x_lay.dim == k_dim and x_lay.blocks == 1:
            if not isinstance(split_layouts(bound, k, ways), str):
                return NodePlan(k, ways, note="row-parallel")
        if not lookahead.reaches_consumer(node.outputs[0]):
            return NodePlan(note="no row-parallel consumer or loss downstream: kept whole")
        blocks = blocks_hint(graph, node.outputs[0]) if node.op not in _CHANNEL_FIRST else 1
        if not isinstance(split_layouts(bound, n, ways, blocks), str):
            return NodePlan(n, ways, blocks, note="column-parallel")
        return NodePlan(note=f"output features cannot be split {ways} ways: kept whole")

    if ways == 1:
        plans = propagate(graph, ways, None)
        return Plan("tp", ways, plans, ())
    weight_views: dict[str, tuple[int, int]] = {}

    def decide_with_weight_views(state: PropagationState, node: Node, bound: BoundAnno) -> NodePlan | None:
        want = weight_views.get(node.name)
        if want is not None and bound.anno.outputs[0].dims:
            dim, blocks = want
            ident = bound.anno.outputs[0].dims[dim].ids[0]
            if not isinstance(split_layouts(bound, ident, ways, blocks), str):
                return NodePlan(ident, ways, blocks, note="weight view, split like its consumer")
        return decide(state, node, bound)

    plans = propagate(graph, ways, decide)
    # A weight reached through a view (experts' transposed weights): split the view too, so the
    # parameter is stored sharded instead of whole and sliced on every step. Second pass.
    weight_views.update(_weight_view_splits(graph, plans))
    if weight_views:
        plans = propagate(graph, ways, decide_with_weight_views)
    return Plan("tp", ways, plans, tuple(f"{name}: {p.note}" for name, p in plans.items() if p.note))


def _weight_view_splits(graph: Graph, plans: dict[str, NodePlan]) -> dict[str, tuple[int, int]]:
    """View nodes over a parameter whose consumer needs the view sharded: node name -> output dim."""
    from nnscaler.graph.ops import annotate_node, layouts_for

    out: dict[str, tuple[int, int]] = {}
    for node in graph.nodes:
        plan = plans[node.name]
        if node.op not in _WEIGHTED or plan.split is None:
            continue
        refs = [r for r in iter_refs((node.args, node.kwargs)) if graph.values[r.name].meta]
        weight = graph.values[refs[_WEIGHTED[node.op][1]].name]
        if weight.kind == "param" or weight.producer is None:
            continue
        lay = layouts_for(annotate_node(node, graph), get_rule(node.op), plan.split, plan.ways, plan.blocks)
        if isinstance(lay, str):
            continue
        need = lay.inputs[_WEIGHTED[node.op][1]]
        if isinstance(need, Shard) and plans[weight.producer].split is None:
            out[weight.producer] = (need.dim, need.blocks)
    return out
