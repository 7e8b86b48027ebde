"""What the SPMD integer program is built from: the candidate choices of every representative node
(repeated layers folded onto one, layers.py) and the edges between them, with the memory limit and the
step's micro-batch count. Raises PlanError when even the leanest choices exceed the memory limit."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from nnscaler.errors import PlanError
from nnscaler.graph.ir import Graph
from nnscaler.policies.autodist.choices import Choice, NodeChoices, node_choices
from nnscaler.policies.autodist.cluster import shipped_clusters
from nnscaler.policies.autodist.constraints import PartitionConstraints
from nnscaler.policies.autodist.cost import CostContext
from nnscaler.policies.autodist.layers import LayerFold, fold_layers
from nnscaler.policies.autodist.memo import graph_memo
from nnscaler.policies.autodist.memory import MemoryModel
from nnscaler.policies.plan import NodePlan

__all__ = ["Edge", "SpmdProblem", "build_problem", "no_partition_error", "weighted_memory", "MEMORY_ADVICE"]

Edge = tuple
"""(producer representative or None, output index or the value's kind when there is no producer,
consumer representative, its input slot, value name)."""


@dataclass
class SpmdProblem:
    """Everything the integer program needs (spmd_program.py builds it, spmd.py decodes it)."""

    graph: Graph
    ctx: CostContext
    folded: LayerFold
    reps: list[str]
    """Representative node names in graph order: one decision each."""
    table: dict[str, NodeChoices]
    """Representative -> its candidate choices."""
    edges: dict[Edge, int]
    """Edge -> how many edges of the graph it stands for."""
    mem_limit: float | None
    mem_weights: tuple[float, float]
    nmicros: int


def build_problem(
    graph: Graph,
    ctx: CostContext,
    memory: MemoryModel,
    *,
    constraints: PartitionConstraints | None,
    mem_limit: float | None,
    recompute: tuple[str, ...],
    pivots: tuple[str, ...] | None,
    fold: bool,
    fixed: dict[str, NodePlan] | None,
    nmicros: int,
    mem_weights: tuple[float, float],
) -> SpmdProblem:
    """The problem of solve_spmd's arguments (see there)."""
    folded = fold_layers(graph, pivots, enabled=fold)
    reps = folded.represented()
    table = _choice_table(graph, ctx, memory, reps, constraints=constraints, recompute=recompute, fixed=fixed)
    if mem_limit is not None:  # even the leanest choice of every node over the limit: no program to solve
        least = sum(
            min(weighted_memory(c, mem_weights) for c in table[n].choices) * folded.count[n] for n in reps
        )
        if least > mem_limit:
            raise no_partition_error(ctx, mem_limit, "Infeasible")
    edges = _edges(graph, {n.name for n in graph.nodes}, folded, table)
    return SpmdProblem(graph, ctx, folded, reps, table, edges, mem_limit, mem_weights, nmicros)


def _choice_table(
    graph: Graph,
    ctx: CostContext,
    memory: MemoryModel,
    reps: list[str],
    *,
    constraints: PartitionConstraints | None,
    recompute: tuple[str, ...],
    fixed: dict[str, NodePlan] | None,
) -> dict[str, NodeChoices]:
    """Representative -> its choices (just the fixed plan's where one is given)."""
    owned_by = _owned_by(graph)
    index = {n.name: n for n in graph.nodes}
    table: dict[str, NodeChoices] = {}
    for name in reps:
        node = index[name]
        owned_here = owned_by.get(name, set())
        only = fixed.get(name) if fixed else None
        cons = None if only else constraints
        nc = node_choices(graph, node, ctx, memory, owned_here, cons, only=only, recompute=tuple(recompute))
        if fixed and name in fixed:
            keep = [c for c in nc.choices if c.plan == fixed[name]]
            if not keep:
                raise PlanError(
                    f"loaded plan gives node {name} ({node.op}) {fixed[name]}, which is not a valid split here"
                )
            nc.choices = keep
        table[name] = nc
    return table


def _owned_by(graph: Graph) -> dict[str, set[str]]:
    """Node -> the parameters and buffers it accounts for (those it is the first reader of); once per
    graph."""
    memo = graph_memo(graph)
    if "owned_by" not in memo:
        owner: dict[str, str] = {}
        for node in graph.nodes:
            for ref in node.input_names():
                if graph.values[ref].kind in ("param", "buffer") and ref not in owner:
                    owner[ref] = node.name
        owned_by: dict[str, set[str]] = defaultdict(set)
        for ref, name in owner.items():
            owned_by[name].add(ref)
        memo["owned_by"] = dict(owned_by)
    return memo["owned_by"]


def _edges(graph: Graph, names: set[str], fold: LayerFold, table: dict[str, NodeChoices]) -> dict[Edge, int]:
    """Edge (see Edge) -> multiplicity; once per graph and fold (a node's tensor inputs do not depend on
    its choices; the folds are kept in the graph's memo, so their ids are theirs while it lives)."""
    memo = graph_memo(graph).setdefault("spmd_edges", {})
    key = (id(fold), len(names))
    if key not in memo:
        memo[key] = _all_edges(graph, names, fold, table)
    return memo[key]


def _all_edges(
    graph: Graph, names: set[str], fold: LayerFold, table: dict[str, NodeChoices]
) -> dict[Edge, int]:
    edges: dict[Edge, int] = defaultdict(int)
    index = {n.name: n for n in graph.nodes}
    for node in graph.nodes:
        if node.name not in names:
            continue
        v = fold.rep[node.name]
        for slot, ref in enumerate(table[v].refs if v in table else []):
            value = graph.values[ref]
            if value.producer is not None and value.producer in index and value.producer in names:
                u = fold.rep[value.producer]
                oi = index[value.producer].outputs.index(ref)
                edges[(u, oi, v, slot, ref)] += 1
            else:
                edges[(None, value.kind, v, slot, ref)] += 1
    return edges


def weighted_memory(c: Choice, weights: tuple[float, float]) -> float:
    """A choice's bytes with (weights + optimizer state, activations) scaled by `weights`."""
    act = c.activation_bytes
    return (c.memory - act) * weights[0] + act * weights[1]


MEMORY_ADVICE = ": raise pas_config['mem_constraint'], use more devices, recompute (recompute_modules) or ZeRO (zero_stage)"
"""How no_partition_error's message goes on after the reason (search.py lists reasons without it)."""


def no_partition_error(ctx: CostContext, mem_limit: float | None, status: str) -> PlanError:
    """The PlanError for a stage no partition of which fits `mem_limit`: names the cluster planned for and
    how to plan for another."""
    limit = "no memory limit" if mem_limit is None else f"{mem_limit / 1e9:.2f} GB per device"
    if mem_limit is not None and mem_limit <= 0:
        limit = (
            f"the memory left per device ({mem_limit / 1e9:.2f} GB once transient buffers and what a "
            "pipeline stage keeps are set aside: the device limit is smaller than they are)"
        )
    return PlanError(
        f"autodist found no partition over {ctx.ways} devices within {limit} (solver status "
        f"{status}) on cluster {ctx.cluster.describe()}{MEMORY_ADVICE}; to plan for another cluster, set "
        f"pas_config['cluster'] to a cluster YAML file or a shipped example {shipped_clusters()}, or run "
        "`python -m nnscaler.plan --cluster <file.yaml>`"
    )
