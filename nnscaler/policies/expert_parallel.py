"""Expert parallelism: the experts of mixture-of-experts layers split over a mesh axis of their own,
composed with a tensor-parallel plan.

Capture turns each recognised experts module into one op (graph/capture/moe.py); the router before
it is ordinary ops. On the `ep` axis every op is split by the batch, as data parallelism would split
it (the forward's tensor inputs on dim 0, every op following), so the ep devices are data-parallel
ranks for everything but the experts: non-expert weights are replicated along the axis and their
gradients summed over it (the partition's copy_to_group). The experts op, reached by tokens split
the same way, is split on its expert dim `e`: its special (nnscaler.runtime.moe) sends each token to
the rank of its experts and back with all-to-alls; each device stores E / ep experts, whose gradients
come whole from the tokens it received (summed only across data-parallel replicas of the plan).

With tensor parallelism too, the stage's devices form the mesh (ep, tp): each node takes its batch
split on axis 0 and its tp plan's split on the others; the experts op splits its intermediate
features `i` on the tp axis (partial sums, reduced after it), as a column- then row-parallel MLP.
"""

from __future__ import annotations

from nnscaler.errors import PlanError
from nnscaler.graph.ir import Graph, Node, Shard, iter_refs
from nnscaler.graph.ops import BoundAnno, annotate_node, get_rule, layouts_for, mesh_layouts_for
from nnscaler.graph.ops.moe import MOE_EXPERTS_OP
from nnscaler.policies.plan import NodePlan, Plan
from nnscaler.policies.propagate import PropagationState, propagate

__all__ = ["experts_nodes", "token_plans", "with_expert_parallel", "check_expert_parallel", "check_ep_size"]


def check_ep_size(ep: int, devices: int, cp: object, policy: str) -> None:
    """`ep` must divide the devices it is taken from, and goes without context parallelism (for now)."""
    if cp is not None:
        raise PlanError(
            f"policy {policy!r}: pas_config['ep_size'] and pas_config['cp_size'] together are not supported yet; "
            "use one of them"
        )
    if devices % ep:
        raise PlanError(
            f"policy {policy!r}: pas_config['ep_size']={ep} does not divide the {devices} devices it splits "
            "(plan_ngpus, or a pipeline stage's devices): the devices form an ep_size x tensor-parallel mesh"
        )


def experts_nodes(graph: Graph) -> list[Node]:
    """The experts op of every recognised mixture-of-experts layer, in program order."""
    return [n for n in graph.nodes if n.op == MOE_EXPERTS_OP]


def _where(node: Node) -> str:
    return f"{node.name} ({node.module_path or 'top level'}, {node.source or 'unknown line'})"


def check_expert_parallel(graph: Graph, ep: int) -> list[Node]:
    """The experts nodes, after checking that `ep` devices can split each one's experts."""
    nodes = experts_nodes(graph)
    if not nodes:
        raise PlanError(
            f"pas_config['ep_size']={ep} but the model has no recognised mixture-of-experts layer (an experts "
            "module with gate_up_proj [E, 2I, H], down_proj [E, H, I], act_fn and forward(hidden_states, "
            "top_k_index, top_k_weights); docs/moe.md); drop ep_size"
        )
    for node in nodes:
        experts = annotate_node(node, graph).sizes["e"]
        if experts % ep:
            raise PlanError(
                f"pas_config['ep_size']={ep} does not divide the {experts} experts of {_where(node)}: use an "
                f"ep_size that divides {experts}"
            )
    return nodes


class _TokenDecider:
    """Split the batch dim of the forward's inputs; an experts op reading split tokens runs the special."""

    def __init__(self, graph: Graph, ways: int, experts: list[Node]):
        self.graph, self.ways = graph, ways
        self.inputs = set(graph.inputs)
        self.experts = {n.name for n in experts}

    def __call__(self, state: PropagationState, node: Node, bound: BoundAnno) -> NodePlan | None:
        if node.name in self.experts:
            tokens = state.input_layouts(node)[0]
            if isinstance(tokens, Shard) and tokens.dim == 0 and tokens.blocks == 1:
                return NodePlan(
                    "e", self.ways, note=f"expert parallel: {self.ways} ways, tokens by all-to-all"
                )
            return None
        refs = [r for r in iter_refs((node.args, node.kwargs)) if self.graph.values[r.name].meta]
        for ref, t in zip(refs, bound.anno.inputs):
            if ref.name in self.inputs and t.dims and self.graph.values[ref.name].meta.shape:
                ident = t.dims[0].ids[0]
                if not isinstance(layouts_for(bound, get_rule(node.op), ident, self.ways), str):
                    return NodePlan(ident, self.ways, note="expert parallel axis: batch split")
                return NodePlan(note=f"batch dim of {ref.name} cannot be split {self.ways} ways: kept whole")
        return None


def token_plans(graph: Graph, ways: int) -> dict[str, NodePlan]:
    """Every node's split over the `ways` devices of the ep axis: the batch, and experts by expert."""
    nodes = check_expert_parallel(graph, ways)
    plans = propagate(graph, ways, _TokenDecider(graph, ways, nodes), allow_partial_to_shard=True)
    missed = [_where(n) for n in nodes if plans[n.name].split != "e"]
    if missed:
        raise PlanError(
            "expert parallelism: the experts op(s) "
            + ", ".join(missed)
            + " do not receive their tokens split "
            "by the batch (an op before them needs every token, or the batch does not divide by ep_size); "
            "plan without ep_size or report the model"
        )
    return plans


def _expert_tp(node: Node, graph: Graph, tp_mesh: tuple[int, ...]) -> tuple[tuple[str | None, int], ...]:
    """The experts op's splits on the tp axes: its intermediate features on the first, if they divide."""
    bound = annotate_node(node, graph)
    rest = tuple((None, 1) for _ in tp_mesh[1:])
    ok = bound.sizes["i"] % tp_mesh[0] == 0
    return ((("i", 1) if ok else (None, 1)), *rest)


def _combine(node: Node, graph: Graph, tok: NodePlan, tp: NodePlan, mesh: tuple[int, ...]) -> NodePlan:
    """The node's ep-axis split on mesh axis 0 and its tp plan's splits on the rest (the tp splits alone
    where both cannot hold at once: the tokens are then gathered for it)."""
    first = (tok.split, tok.blocks) if tok.is_split else (None, 1)
    if node.op == MOE_EXPERTS_OP:
        return NodePlan(note=tok.note, mesh_splits=(first, *_expert_tp(node, graph, mesh[1:])))
    tp_splits = (
        tuple(tp.mesh_splits) if tp.mesh_splits else ((tp.split, tp.blocks) if tp.is_split else (None, 1),)
    )
    if first[0] is None and all(ident is None for ident, _ in tp_splits):
        return NodePlan(note=tp.note)
    if first[0] in {ident for ident, _ in tp_splits}:
        first = (None, 1)
    bound = annotate_node(node, graph)
    splits = (first, *tp_splits)
    if bound is None or isinstance(mesh_layouts_for(bound, get_rule(node.op), splits, mesh), str):
        splits = ((None, 1), *tp_splits)
    notes = "; ".join(n for n in (tok.note if splits[0][0] else "", tp.note) if n)
    return NodePlan(note=notes, mesh_splits=splits)


def with_expert_parallel(graph: Graph, tp_plan: Plan, ep: int) -> Plan:
    """`tp_plan` (over each stage's tp devices) with the batch and the experts split over `ep` more: the
    stage mesh becomes (ep, *tp mesh), or the ep axis alone when the tp plan has one device per stage."""
    tokens = token_plans(graph, ep)
    note = f"expert parallel {ep} over mesh axis 0" if tp_plan.tp_size > 1 else f"expert parallel {ep}"
    notes = (*tp_plan.notes, note)
    if tp_plan.tp_size == 1:
        return Plan(
            tp_plan.policy, tp_plan.plan_ngpus * ep, tokens, notes, tp_plan.recompute, tp_plan.pipeline
        )
    mesh = (ep, *(tp_plan.mesh or (tp_plan.tp_size,)))
    nodes = {n.name: _combine(n, graph, tokens[n.name], tp_plan.node(n.name), mesh) for n in graph.nodes}
    return Plan(
        tp_plan.policy, tp_plan.plan_ngpus * ep, nodes, notes, tp_plan.recompute, tp_plan.pipeline, mesh=mesh
    )
