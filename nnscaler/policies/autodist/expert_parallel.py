"""The cost of expert parallelism (the experts of every mixture-of-experts layer split over `ep`
devices of each stage, tokens split by batch on that axis) on top of the per-rank problem the search
plans (autodist/ep_search.py).

The stage's devices form the mesh (ep, tp) (policies/expert_parallel.py), so ep ranks are `tp` apart:
the all-to-alls run on `cluster.link(ep, tp)`, NVLink while the ep group fits in a node, the
inter-node link otherwise. The per-rank problem is plan_ngpus / ep devices with 1/ep of the tokens
and ep x dp replicas (ep_search.ep_setup); it holds every token-wise cost: the router, attention,
and the experts' compute, which is each rank's own tokens' share (T/ep tokens x top_k experts,
whichever rank computes them; costed as grouped GEMMs on E / ep experts, autodist/expert_gemm.py).
Its cost context carries `ep_degree`, so that for the experts ops
(choices.py, CostContext.experts_context):

- memory: each rank keeps E / ep experts: weights, gradients and optimizer state 1/ep of the tp
  split's, ZeRO sharding them over the expert replica group (dp) instead of ep x dp;
- gradient sync: expert gradients are reduced only over the expert replica group (dp replicas,
  ep x (plan_ngpus / ep) apart) with 1/ep of the bytes; non-expert weights keep the per-rank
  problem's sync over ep x dp (copy_to_group over the ep axis, then across replicas).

Here, per MoE layer and per rank, the all-to-alls: one buffer is tokens_per_rank x hidden x top_k x
dtype bytes (every assignment's hidden row; tokens replicated over the tp ranks of an ep rank);
dispatch and combine each move it forward, and their gradients backward: 4 all-to-alls per
micro-batch (6 under recompute, the forward twice), each `comm.all_to_all` over the ep group
((ep - 1) / ep of it leaves the rank); not overlapped with compute (the experts wait for their rows).

The tp-split experts (the experts' intermediate features split by tp, tokens replicated) are the
ep = 1 candidates the search already costs. Under a pipeline the layers' all-to-alls are spread
evenly over the stages (the step pays (nmicros + pp - 1) slots of one stage's share), as for cp.
"""

from __future__ import annotations

from dataclasses import dataclass

from nnscaler.graph.ir import Graph
from nnscaler.graph.ops import annotate_node
from nnscaler.policies.autodist.cluster import ClusterSpec, LinkSpec
from nnscaler.policies.autodist.comm import all_to_all
from nnscaler.policies.autodist.cost import CostContext
from nnscaler.policies.expert_parallel import experts_nodes

__all__ = ["MoeLayer", "EpCost", "moe_layers", "ep_cost", "ep_link", "A2A_PER_MICRO"]

A2A_PER_MICRO = 4
"""All-to-alls per MoE layer per micro-batch: dispatch and combine, forward and backward."""


@dataclass(frozen=True)
class MoeLayer:
    """One experts op as one rank of the per-rank problem sees it."""

    name: str
    experts: int
    top_k: int
    a2a_bytes: float
    """One all-to-all buffer: tokens of this rank x hidden x top_k x dtype bytes."""


@dataclass(frozen=True)
class EpCost:
    """What expert parallelism adds to a candidate of the per-rank problem, per step."""

    comm: float
    """Seconds of all-to-alls on the critical path."""
    bytes: float
    """Bytes per device of those all-to-alls."""


def moe_layers(graph: Graph, ctx: CostContext) -> list[MoeLayer]:
    """Every experts op of the per-rank problem solved under `ctx` (its batch_scale holds 1/ep)."""
    out = []
    for node in experts_nodes(graph):
        sizes = annotate_node(node, graph).sizes
        hidden = ctx.value_bytes(graph, node.input_names()[0])
        out.append(MoeLayer(node.name, sizes["e"], sizes["k"], hidden * sizes["k"]))
    return out


def ep_link(cluster: ClusterSpec, ep: int, tp: int) -> LinkSpec:
    """The link an ep group of `ep` ranks `tp` apart spans."""
    return cluster.link(ep, tp)


def ep_cost(
    layers: list[MoeLayer], ep: int, tp: int, cluster: ClusterSpec, schedule: tuple[int, int, bool]
) -> EpCost:
    """The per-step all-to-alls of `layers` over `ep` ranks `tp` apart; `schedule`: (nmicros, pp,
    recompute)."""
    if ep <= 1 or not layers:
        return EpCost(0.0, 0.0)
    nmicros, pp, recompute = schedule
    link = ep_link(cluster, ep, tp)
    per_micro = A2A_PER_MICRO + (2 if recompute else 0)
    slots = nmicros if pp == 1 else (nmicros + pp - 1) / pp
    comm = sum(per_micro * all_to_all(x.a2a_bytes, ep, link) for x in layers) * slots
    nbytes = sum(per_micro * x.a2a_bytes for x in layers) * nmicros / pp
    return EpCost(comm, nbytes)
