"""The cost of context parallelism (the sequence split over `c` devices of each stage) on top of the
per-rank problem the search plans (autodist/cp_search.py): what the ring, the zigzag reorder and the
Ulysses all-to-alls add to a micro-batch, on the links the cp ranks use.

The stage's devices form the mesh (cp, tp) (policies/context_parallel.py), so cp ranks are `tp`
apart: a Ulysses group of `u` consecutive cp positions is `link(u, tp)`, a ring over all `c`
positions `link(c, tp)`, and hybrid's rings (positions of one index in their Ulysses groups) are
`link(c / u, u * tp)`. Per self-attention call, per rank (bytes after the cp and tp splits):

- ring / zigzag / hybrid's ring of n positions: forward n - 1 exchanges of the K/V block, each
  overlapped with one block's compute (a step costs max(exchange, block)); backward n - 1 K/V and n
  dK/dV exchanges (accumulators in fp32), the last dK/dV not overlapped. A plain ring on a causal
  mask leaves the last rank (2n - 1) / n times the average attention work (zigzag balances it).
- zigzag's reorder (causal only; also hybrid's): q/k/v to the zigzag layout and the output back,
  half of each tensor moving, forward and (the gradients) backward; not overlapped.
- ulysses (and hybrid's groups): all-to-alls of q, k, v and the output forward, their gradients
  backward, (u - 1) / u of each tensor moving; not overlapped.
Under recompute the forward's share runs twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nnscaler.graph.ir import Graph
from nnscaler.graph.ops import annotate_node
from nnscaler.policies.autodist.cluster import ClusterSpec, LinkSpec
from nnscaler.policies.autodist.comm import all_to_all, send_recv
from nnscaler.policies.autodist.cost import CostContext
from nnscaler.policies.autodist.spmd import SpmdResult
from nnscaler.policies.context_parallel import attention_nodes
from nnscaler.policies.plan import ContextParallel, NodePlan

__all__ = ["AttentionCall", "CpCost", "attention_calls", "cp_cost", "kind_refusal", "sequence_length"]

ACC_BYTES = 4
"""Bytes per element of the dK/dV accumulators that travel the ring in backward (fp32)."""


@dataclass(frozen=True)
class AttentionCall:
    """One self-attention call as one cp rank sees it (bytes after the cp and tp splits)."""

    name: str
    q_bytes: float
    kv_bytes: float
    """K and V together: the block one ring exchange moves."""
    out_bytes: float
    kv_elems: float
    heads: int
    """Query heads per tensor-parallel rank (what Ulysses splits further)."""
    compute: float
    """Seconds of this rank's attention compute per micro-batch, forward + backward (1/c of the work)."""
    causal: bool


@dataclass(frozen=True)
class CpCost:
    """Seconds per micro-batch (all attention calls) that context parallelism costs."""

    comm: float
    """Every cp transfer, hidden behind compute or not."""
    exposed: float
    """What the micro-batch takes longer: transfers not hidden, all-to-alls, a plain ring's imbalance."""


def sequence_length(graph: Graph) -> int | None:
    """The self-attention's sequence length (None: no self-attention, or several lengths)."""
    lengths = {annotate_node(n, graph).sizes["s"] for n in attention_nodes(graph)}
    return lengths.pop() if len(lengths) == 1 else None


def _is_causal(node) -> bool:
    if "is_causal" in node.kwargs:
        return bool(node.kwargs["is_causal"])
    return len(node.args) > 5 and bool(node.args[5])


def _split_ways(plan: NodePlan, mesh: tuple[int, ...], idents: set[str]) -> tuple[int, int]:
    """(devices the node is split over, of which over the query heads `idents`)."""
    if plan.mesh_splits:
        axes = [(ident, size) for (ident, _), size in zip(plan.mesh_splits, mesh) if ident is not None]
    else:
        axes = [(plan.split, plan.ways)] if plan.is_split else []
    total = math.prod(size for _, size in axes)
    heads = math.prod(size for ident, size in axes if ident in idents)
    return total, heads


def attention_calls(graph: Graph, ctx: CostContext, res: SpmdResult) -> list[AttentionCall]:
    """Every self-attention call of the per-rank problem `res` (solved under `ctx`, whose batch_scale
    holds the 1/c of the sequence)."""
    out = []
    for node in attention_nodes(graph):
        bound = annotate_node(node, graph)
        q, k, v = node.input_names()[:3]
        q_ids = set(bound.anno.inputs[0].dims[-3].ids)
        ways, head_ways = _split_ways(res.plans[node.name], res.mesh, q_ids)
        kv_elems = sum(graph.values[x].meta.numel * ctx.value_scale(graph, x) for x in (k, v)) / ways
        out.append(
            AttentionCall(
                node.name,
                ctx.value_bytes(graph, q) / ways,
                (ctx.value_bytes(graph, k) + ctx.value_bytes(graph, v)) / ways,
                sum(ctx.value_bytes(graph, o) for o in node.outputs) / ways,
                kv_elems,
                graph.values[q].meta.shape[-3] // head_ways,
                res.choice[node.name].compute,
                _is_causal(node),
            )
        )
    return out


def kind_refusal(calls: list[AttentionCall], cp: ContextParallel, seq: int) -> str | None:
    """Why `cp` cannot run these calls (None: it can): the sequence's chunks, the heads Ulysses splits."""
    causal = any(a.causal for a in calls)
    chunks = 2 * cp.size if cp.kind == "zigzag" or (cp.kind == "hybrid" and causal) else cp.size
    if seq % chunks:
        return f"the sequence ({seq}) is not divisible into {chunks} equal chunks"
    group = {"ulysses": cp.size, "hybrid": cp.ulysses_size}.get(cp.kind, 1)
    bad = [a for a in calls if a.heads % group]
    if bad:
        return (
            f"{bad[0].heads} query heads per tensor-parallel rank are not divisible by the {group} "
            "Ulysses devices"
        )
    return None


def _ring(a: AttentionCall, n: int, link: LinkSpec, rc: bool, plain: bool) -> tuple[float, float]:
    """(comm, exposed) of one call's ring over n positions (`rc`: the forward runs twice; `plain`: a
    ring without zigzag's balance)."""
    if n <= 1:
        return 0.0, 0.0
    kv = send_recv(a.kv_bytes, 2, link)
    acc = send_recv(a.kv_elems * ACC_BYTES, 2, link)
    imbalance = (2 * n - 1) / n if a.causal and plain else 1.0
    fwd_block, bwd_block = a.compute * imbalance / 3 / n, 2 * a.compute * imbalance / 3 / n
    fwd = (n - 1) * kv, (n - 1) * max(0.0, kv - fwd_block)
    bwd = (n - 1) * kv + n * acc, (n - 1) * max(0.0, kv + acc - bwd_block) + acc
    extra = (imbalance - 1.0) * a.compute * (4.0 / 3.0 if rc else 1.0)
    times = 2 if rc else 1
    return times * fwd[0] + bwd[0], times * fwd[1] + bwd[1] + extra


def _ulysses(a: AttentionCall, u: int, link: LinkSpec, rc: bool) -> float:
    """Seconds of one call's Ulysses all-to-alls over u devices (forward, backward)."""
    if u <= 1:
        return 0.0
    one = sum(all_to_all(b, u, link) for b in (a.q_bytes, a.kv_bytes / 2, a.kv_bytes / 2, a.out_bytes))
    return one * ((2 if rc else 1) + 1)


def _reorder(a: AttentionCall, c: int, link: LinkSpec, rc: bool) -> float:
    """Seconds of one call's zigzag reorders over c devices: q/k/v in, the output back (half moves)."""
    if c <= 1 or not a.causal:
        return 0.0
    one = 2 * (c - 1) * link.alpha + 0.5 * (a.q_bytes + a.kv_bytes + a.out_bytes) / link.beta
    return one * ((2 if rc else 1) + 1)


def cp_cost(
    calls: list[AttentionCall], cp: ContextParallel, cluster: ClusterSpec, tp: int, recompute: bool
) -> CpCost:
    """The cp cost per micro-batch of `calls` under `cp`, its cp ranks `tp` apart."""
    c, u = cp.size, {"ulysses": cp.size, "hybrid": cp.ulysses_size}.get(cp.kind, 1)
    n = c // u
    ring_link, ulysses_link = cluster.link(n, u * tp), cluster.link(u, tp)
    comm = exposed = 0.0
    for a in calls:
        ring_comm, ring_exposed = _ring(a, n, ring_link, recompute, cp.kind == "ring")
        alltoall = _ulysses(a, u, ulysses_link, recompute)
        if cp.kind in ("zigzag", "hybrid") and n > 1:
            alltoall += _reorder(a, c, cluster.link(c, tp), recompute)
        comm += ring_comm + alltoall
        exposed += ring_exposed + alltoall
    return CpCost(comm, exposed)
