"""Built-in policies: dp (replicate), data (split the batch), tp (Megatron-style tensor parallelism)."""

from __future__ import annotations

from nnscaler.config import ComputeConfig
from nnscaler.errors import PlanError
from nnscaler.graph.ir import Graph, Node, Shard, iter_refs
from nnscaler.graph.ops import BoundAnno, split_layouts
from nnscaler.policies.blocks import blocks_hint
from nnscaler.policies.plan import NodePlan, Plan
from nnscaler.policies.propagate import PropagationState, propagate

__all__ = ["pas_dp", "pas_data", "pas_tp"]

_LINEAR_WEIGHT = {
    "aten.linear.default": (0, 1),
    "aten.addmm.default": (1, 2),
    "aten.mm.default": (0, 1),
    "aten.matmul.default": (0, 1),
}


def _notes(plans: dict[str, NodePlan]) -> tuple[str, ...]:
    return tuple(f"{name}: {p.note}" for name, p in plans.items() if p.note)


def _from_input(graph: Graph, value: str, depth: int = 4) -> bool:
    """True when `value` is a forward input or a view/cast of one (token ids, not positions)."""
    v = graph.values[value]
    if v.kind == "input":
        return True
    if v.producer is None or depth == 0:
        return False
    node = graph.node(v.producer)
    return len(node.input_names()) == 1 and _from_input(graph, node.input_names()[0], depth - 1)


def pas_dp(graph: Graph, cfg: ComputeConfig) -> Plan:
    """Replicate everything on the single plan device; data parallelism comes from runtime_ngpus."""
    if cfg.plan_ngpus != 1:
        raise PlanError(
            f"policy 'dp' needs ComputeConfig.plan_ngpus == 1, got {cfg.plan_ngpus}; use 'tp' or 'data'"
        )
    return Plan("dp", 1, {n.name: NodePlan() for n in graph.nodes})


def pas_data(graph: Graph, cfg: ComputeConfig) -> Plan:
    """Split the batch (dim 0 of the forward's tensor inputs) over the plan devices; ops follow."""
    ways = cfg.plan_ngpus
    inputs = set(graph.inputs)

    def decide(state: PropagationState, node: Node, bound: BoundAnno) -> NodePlan | None:
        refs = [r for r in iter_refs((node.args, node.kwargs)) if graph.values[r.name].meta]
        for ref, t in zip(refs, bound.anno.inputs):
            if ref.name in inputs and t.dims and graph.values[ref.name].meta.shape:
                ident = t.dims[0].ids[0]
                if not isinstance(split_layouts(bound, ident, ways), str):
                    return NodePlan(ident, ways)
                return NodePlan(note=f"batch dim of {ref.name} cannot be split {ways} ways: kept whole")
        return None

    plans = propagate(graph, ways, decide if ways > 1 else None, allow_partial_to_shard=True)
    return Plan("data", ways, plans, _notes(plans))


def pas_tp(graph: Graph, cfg: ComputeConfig) -> Plan:
    """Megatron-style tensor parallelism.

    A linear whose input arrives sharded on its reduction dim is row-parallel (partial sums, one
    all-reduce); any other linear with a weight parameter is column-parallel (split output features;
    fused q/k/v weights are split per block so each device gets whole heads). Embeddings split the
    vocabulary, and a loss over vocab-sharded logits becomes vocab-parallel cross entropy. Everything
    else follows its inputs, so the activations between a column and a row linear (activation
    functions, attention by heads) stay sharded with no communication.
    """
    ways = cfg.plan_ngpus

    def decide(state: PropagationState, node: Node, bound: BoundAnno) -> NodePlan | None:
        refs = [r for r in iter_refs((node.args, node.kwargs)) if graph.values[r.name].meta]
        if node.op in _LINEAR_WEIGHT and len(refs) > _LINEAR_WEIGHT[node.op][1]:
            x_idx, w_idx = _LINEAR_WEIGHT[node.op]
            if graph.values[refs[w_idx].name].kind != "param":
                return None
            x_lay = state.layout(refs[x_idx].name)
            k_dim = len(graph.values[refs[x_idx].name].meta.shape) - 1
            if isinstance(x_lay, Shard) and x_lay.dim == k_dim and x_lay.blocks == 1:
                if not isinstance(split_layouts(bound, "k", ways), str):
                    return NodePlan("k", ways, note="row-parallel")
            blocks = blocks_hint(graph, node.outputs[0])
            if not isinstance(split_layouts(bound, "n", ways, blocks), str):
                return NodePlan("n", ways, blocks, note="column-parallel")
            return NodePlan(note=f"output features cannot be split {ways} ways: kept whole")
        if node.op == "aten.embedding.default" and graph.values[refs[0].name].kind == "param":
            if not _from_input(graph, refs[1].name):
                return NodePlan(note="indices are not token ids from the forward's inputs: kept whole")
            if not isinstance(split_layouts(bound, "v", ways), str):
                return NodePlan("v", ways, note="vocab-parallel")
            return NodePlan(note=f"vocabulary cannot be split {ways} ways: kept whole")
        return None

    plans = propagate(graph, ways, decide if ways > 1 else None)
    return Plan("tp", ways, plans, _notes(plans))
