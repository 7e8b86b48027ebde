"""Layout propagation: walk the graph in order, letting each node follow the layouts of its inputs.

A policy fixes the nodes it cares about (e.g. tp fixes linears and embeddings); every other node
takes the split that needs the least communication to read its inputs, and stays replicated when
nothing is sharded. This is how a column-split linear's sharded output flows through activations,
views and attention to the row-split linear without any communication in between.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from nnscaler.graph.ir import Graph, Layout, Node, Partial, Replicate, Shard, iter_refs
from nnscaler.graph.ops import BoundAnno, annotate_node, get_rule, layouts_for, split_candidates
from nnscaler.policies.plan import REPLICATE, NodePlan

__all__ = ["PropagationState", "propagate", "conversion_cost"]

_INF = float("inf")


@dataclass
class PropagationState:
    """Layouts known so far: activations by value name; params get one when first read."""

    graph: Graph
    ways: int
    layouts: dict[str, Layout]

    def layout(self, name: str) -> Layout | None:
        """None for a parameter or buffer not yet placed (its storage layout is still free)."""
        return self.layouts.get(name)

    def input_layouts(self, node: Node) -> list[Layout | None]:
        return [
            self.layout(r.name) for r in iter_refs((node.args, node.kwargs)) if self.graph.values[r.name].meta
        ]


def conversion_cost(
    src: Layout | None, dst: Layout | None, nbytes: int, allow_partial_to_shard: bool
) -> float:
    """Bytes moved to turn layout src into dst (tiny for a local slice; inf when not allowed)."""
    if src is None or dst is None or src == dst:
        return 0.0
    if isinstance(src, Replicate):
        return 1e-3 * nbytes if isinstance(dst, Shard) else _INF
    if isinstance(src, Partial):
        if isinstance(dst, Replicate):
            return 2.0 * nbytes
        return 1.0 * nbytes if allow_partial_to_shard else _INF
    if isinstance(dst, Replicate):
        return 1.0 * nbytes
    if isinstance(dst, Shard):
        return 0.5 * nbytes if src.dim != dst.dim and src.blocks == dst.blocks == 1 else 2.0 * nbytes
    return _INF


def _nbytes(graph: Graph, name: str) -> int:
    meta = graph.values[name].meta
    return meta.numel * 4 if meta else 0


def _score(state: PropagationState, node: Node, bound: BoundAnno, plan: NodePlan, allow_p2s: bool) -> float:
    lay = layouts_for(bound, get_rule(node.op), plan.split, state.ways if plan.split else 1, plan.blocks)
    if isinstance(lay, str):
        return _INF
    refs = [r for r in iter_refs((node.args, node.kwargs)) if state.graph.values[r.name].meta]
    cost = 0.0
    for ref, req in zip(refs, lay.inputs):
        cost += conversion_cost(
            state.layout(ref.name), req or Replicate(), _nbytes(state.graph, ref.name), allow_p2s
        )
    return cost


def _blocks_from_inputs(state: PropagationState, node: Node, bound: BoundAnno, ident: str) -> int:
    """Reuse a strided input's block count when the split identifier sits on that input's sharded dim."""
    refs = [r for r in iter_refs((node.args, node.kwargs)) if state.graph.values[r.name].meta]
    for ref, t in zip(refs, bound.anno.inputs):
        lay = state.layout(ref.name)
        if isinstance(lay, Shard) and lay.blocks > 1 and t.dims is not None and lay.dim < len(t.dims):
            d = t.dims[lay.dim]
            if d.ids[0] == ident:
                return lay.blocks
    return 1


def best_follow(state: PropagationState, node: Node, bound: BoundAnno, allow_p2s: bool) -> NodePlan:
    """The cheapest split given the inputs' layouts; replicate when nothing beats it."""
    best, best_cost = REPLICATE, _score(state, node, bound, REPLICATE, allow_p2s)
    if best_cost == 0.0 or state.ways == 1:
        return best
    for ident in split_candidates(bound, state.ways):
        blocks = _blocks_from_inputs(state, node, bound, ident)
        cand = NodePlan(ident, state.ways, blocks)
        cost = _score(state, node, bound, cand, allow_p2s)
        if cost < best_cost:
            best, best_cost = cand, cost
    return best


Decide = Callable[[PropagationState, Node, BoundAnno], NodePlan | None]


def propagate(
    graph: Graph, ways: int, decide: Decide | None = None, allow_partial_to_shard: bool = False
) -> dict[str, NodePlan]:
    """Choose a NodePlan for every node; `decide` may fix a node's plan (return None to let it follow)."""
    state = PropagationState(graph, ways, {name: Replicate() for name in graph.inputs})
    plans: dict[str, NodePlan] = {}
    for node in graph.nodes:
        bound = annotate_node(node, graph)
        if bound is None:
            plan = NodePlan(note="no annotation: kept whole on every device")
        else:
            plan = (decide(state, node, bound) if decide else None) or best_follow(
                state, node, bound, allow_partial_to_shard
            )
            if plan.split is not None and isinstance(
                layouts_for(bound, get_rule(node.op), plan.split, plan.ways, plan.blocks), str
            ):
                plan = NodePlan(note=f"cannot split on {plan.split!r}: kept whole")
        plans[node.name] = plan
        _record(state, node, bound, plan)
    return plans


def _record(state: PropagationState, node: Node, bound: BoundAnno | None, plan: NodePlan) -> None:
    refs = [r for r in iter_refs((node.args, node.kwargs)) if state.graph.values[r.name].meta]
    if bound is None:
        for out in node.outputs:
            state.layouts[out] = Replicate()
        return
    lay = layouts_for(bound, get_rule(node.op), plan.split, plan.ways if plan.split else 1, plan.blocks)
    for ref, req in zip(refs, lay.inputs):
        if ref.name not in state.layouts and state.graph.values[ref.name].kind in ("param", "buffer"):
            state.layouts[ref.name] = req or Replicate()
    for out, olay in zip(node.outputs, lay.outputs):
        state.layouts[out] = olay or Replicate()
