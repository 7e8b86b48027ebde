"""Built-in policies: dp (replicate), data (split the batch), tp (Megatron-style tensor parallelism)."""

from __future__ import annotations

from nnscaler.config import ComputeConfig
from nnscaler.errors import PlanError
from nnscaler.graph.ir import Graph, Node, iter_refs
from nnscaler.graph.ops import BoundAnno, split_layouts
from nnscaler.policies.plan import NodePlan, Plan
from nnscaler.policies.propagate import PropagationState, propagate

__all__ = ["pas_dp", "pas_data", "pas_autodist"]


def _notes(plans: dict[str, NodePlan]) -> tuple[str, ...]:
    return tuple(f"{name}: {p.note}" for name, p in plans.items() if p.note)


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


def pas_autodist(graph: Graph, cfg: ComputeConfig) -> Plan:
    """The searched plan (nnscaler.policies.autodist; imported on first use: it loads the ILP solver)."""
    from nnscaler.policies.autodist.policy import pas_autodist as search

    return search(graph, cfg)
