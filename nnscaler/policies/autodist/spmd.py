"""SPMD search: one partition per node, minimising compute + resharding + gradient-sync time under a
per-device memory limit, as an integer program (PuLP; CBC, or HiGHS where installed).

Variables: x[n, c] = 1 when node n takes choice c (one per node). For an edge (a value produced by
u, read by v) whose cost depends on both choices, y[e, a, b] in [0, 1] carries the pair (a, b): its sums
over b equal x[u, a] and over a equal x[v, b] (a tight linearisation of x[u, a] * x[v, b]; forbidden
pairs get no variable), and its coefficient is the resharding time of the pair. Repeated layers are folded onto one (layers.py): a representative's terms
are weighted by the number of nodes it stands for, and edges between consecutive layers become
edges of the representative onto itself.
"""

from __future__ import annotations

import math
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass, field

import pulp

from nnscaler.errors import PlanError
from nnscaler.graph.ir import Graph, Replicate
from nnscaler.policies.autodist.choices import Choice, NodeChoices, node_choices
from nnscaler.policies.autodist.comm import all_reduce
from nnscaler.policies.autodist.constraints import PartitionConstraints
from nnscaler.policies.autodist.cost import CostContext, reshard_time
from nnscaler.policies.autodist.layers import LayerFold, fold_layers
from nnscaler.policies.autodist.memo import graph_memo
from nnscaler.policies.autodist.memory import MemoryModel
from nnscaler.policies.plan import NodePlan

__all__ = ["SpmdResult", "solve_spmd", "available_solvers"]

_US = 1e6
"""The objective is scaled to microseconds."""
_EPS_SPLIT = 1e-9
"""A tie-breaker: between equally fast choices prefer replication (fewer splits, simpler code)."""


@dataclass
class SpmdResult:
    """The chosen partition of every node and what the cost model predicts for it."""

    plans: dict[str, NodePlan]
    choice: dict[str, Choice]
    node_time: dict[str, float]
    """Seconds per node: its choice's compute + internal communication + resharding of its inputs."""
    node_comm: dict[str, float]
    """The communication part of node_time."""
    node_memory: dict[str, float]
    node_sync: dict[str, float]
    """Seconds per step of data-parallel gradient sync of the parameters each node owns."""
    time: float
    """Seconds per micro-batch (forward + backward) on one device, without gradient sync."""
    memory: float
    sync: float
    """Seconds per step of data-parallel gradient sync."""
    ways: int
    stats: dict = field(default_factory=dict)
    """ILP size and solve time: variables, constraints, nodes, seconds, solver, status."""

    def step_time(self, nmicros: int = 1) -> float:
        """Seconds per step of `nmicros` micro-batches run one after the other (gradient accumulation)."""
        return self.time * nmicros + self.sync


def available_solvers() -> list[str]:
    names = pulp.listSolvers(onlyAvailable=True)
    return [n for n, s in (("highs", "HiGHS"), ("cbc", "PULP_CBC_CMD")) if s in names]


def _solver(name: str):
    """CBC by default: on these programs it solved as fast as HiGHS or faster (0.05 s vs 0.06 s for a
    folded Llama; 0.10 s vs 0.34 s unfolded, measured here); 'highs' where installed on request."""
    if name == "highs" and "HiGHS" in pulp.listSolvers(onlyAvailable=True):
        return pulp.HiGHS(msg=False), "highs"
    return pulp.PULP_CBC_CMD(msg=False, threads=1), "cbc"


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


def _edges(graph: Graph, names: set[str], fold: LayerFold, table: dict[str, NodeChoices]):
    """(producer rep or None, output index, consumer rep, input slot, value) -> multiplicity."""
    edges: dict[tuple, int] = defaultdict(int)
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


def solve_spmd(
    graph: Graph,
    ctx: CostContext,
    memory: MemoryModel | None = None,
    *,
    constraints: PartitionConstraints | None = None,
    mem_limit: float | None = None,
    recompute: tuple[str, ...] = (),
    pivots: tuple[str, ...] | None = None,
    fold: bool = True,
    solver: str = "auto",
    fixed: dict[str, NodePlan] | None = None,
    nmicros: int = 1,
    mem_weights: tuple[float, float] = (1.0, 1.0),
) -> SpmdResult:
    """Choose every node's partition over ctx.ways devices (see the module docstring).

    mem_limit: bytes per device (None: no limit). recompute: module paths whose activations are
    recomputed (not kept). fixed: node name -> plan that must be taken (a loaded plan). nmicros:
    micro-batches per step (gradient sync happens once per step, everything else per micro-batch).
    mem_weights: multipliers of (weights + optimizer state, activations) in the memory limit (a
    pipeline of p stages keeps 1/p of the weights and, on its first stage, about one micro-batch of
    the whole model's activations: (1/p, 1); with recompute (1/p, 0)).
    """
    with warnings.catch_warnings():  # PuLP 3.3 announces PuLP 4's API changes on every variable
        warnings.simplefilter("ignore", DeprecationWarning)
        return _solve(
            graph,
            ctx,
            memory,
            constraints,
            mem_limit,
            recompute,
            pivots,
            fold,
            solver,
            fixed,
            nmicros,
            mem_weights,
        )


def _solve(
    graph, ctx, memory, constraints, mem_limit, recompute, pivots, fold, solver, fixed, nmicros, mem_weights
) -> SpmdResult:
    memory = memory or MemoryModel()
    folded = fold_layers(graph, pivots, enabled=fold)
    names = {n.name for n in graph.nodes}
    owned_by = _owned_by(graph)
    reps = folded.represented()
    index = {n.name: n for n in graph.nodes}
    table: dict[str, NodeChoices] = {}
    for name in reps:
        node = index[name]
        owned_here = owned_by.get(name, set())
        saved = not any(
            node.module_path == r or node.module_path.startswith(r + ".") or r == "" for r in recompute
        )
        only = fixed.get(name) if fixed else None
        nc = node_choices(graph, node, ctx, memory, owned_here, None if only else constraints, saved, only)
        if fixed and name in fixed:
            keep = [c for c in nc.choices if c.plan == fixed[name]]
            if not keep:
                raise PlanError(
                    f"loaded plan gives node {name} ({node.op}) {fixed[name]}, which is not a valid split here"
                )
            nc.choices = keep
        table[name] = nc
    if mem_limit is not None:  # even the leanest choice of every node over the limit: no program to solve
        least = sum(
            min(_weighted_memory(c, mem_weights) for c in table[n].choices) * folded.count[n] for n in reps
        )
        if least > mem_limit:
            raise _no_partition(ctx, mem_limit, "Infeasible")
    edges = _edges(graph, names, folded, table)
    t0 = time.perf_counter()
    prob = pulp.LpProblem("spmd", pulp.LpMinimize)
    x = {
        (n, i): pulp.LpVariable(f"x_{k}_{i}", cat="Binary")
        for k, n in enumerate(reps)
        for i in range(len(table[n].choices))
    }
    objective: dict[pulp.LpVariable, float] = defaultdict(float)  # variable -> seconds
    for n in reps:
        prob += pulp.lpSum(x[n, i] for i in range(len(table[n].choices))) == 1
        cnt = folded.count[n]
        for i, c in enumerate(table[n].choices):
            per_step = c.time * nmicros + c.sync
            objective[x[n, i]] += (per_step + (_EPS_SPLIT if c.plan.is_split else 0.0)) * cnt
    outputs = set(graph.output_names())
    edge_cost: dict[tuple, list[list[float]]] = {}
    shared_terms: list[tuple] = []
    nvars_y = 0
    readers: dict[tuple, list[tuple]] = defaultdict(list)
    for key in edges:
        if key[0] is not None:
            readers[key[0], key[1]].append(key)
    shared = {k: keys for k, keys in readers.items() if len({(e[2], e[3]) for e in keys}) > 1}
    for (
        u,
        oi,
    ), keys in shared.items():  # one backward all-reduce for all split readers of a replicated value
        ref = keys[0][4]
        meta = graph.values[ref].meta
        if not (ctx.training and meta.requires_grad and ctx.ways > 1):
            continue
        z = pulp.LpVariable(f"z_{nvars_y}", lowBound=0, upBound=1)
        nvars_y += 1
        for _, _, v, slot, _ in keys:
            for b, c in enumerate(table[v].choices):
                if c.plan.is_split and isinstance(c.inputs[slot], Replicate):
                    prob += z >= x[v, b]
        cost = all_reduce(ctx.value_bytes(graph, ref), ctx.ways, ctx.tp_link)
        objective[z] += cost * max(edges[k] for k in keys) * nmicros
        shared_terms.append((u, oi, keys, cost))
    for key, cnt in edges.items():
        u, oi, v, slot, ref = key
        meta = graph.values[ref].meta
        nbytes = ctx.value_bytes(graph, ref)
        sg = (u, oi) in shared
        cv = table[v].choices
        if u is None:
            src = Replicate() if oi == "input" else None
            for b, c in enumerate(cv):
                cost = reshard_time(src, c.inputs[slot], nbytes, ctx, c.plan.is_split, meta.requires_grad)
                if math.isinf(cost):
                    prob += x[v, b] == 0
                elif cost:
                    objective[x[v, b]] += cost * cnt * nmicros
            continue
        cu = table[u].choices
        mat = [
            [
                reshard_time(
                    a.outputs[oi],
                    c.inputs[slot],
                    nbytes,
                    ctx,
                    c.plan.is_split,
                    meta.requires_grad,
                    sg,
                )
                for c in cv
            ]
            for a in cu
        ]
        edge_cost[key] = mat
        if len(cu) == 1 or len(cv) == 1:
            for a in range(len(cu)):
                for b in range(len(cv)):
                    cost = mat[a][b]
                    if math.isinf(cost):
                        prob += x[u, a] + x[v, b] <= 1
                    elif cost > 0:
                        objective[x[v, b] if len(cu) == 1 else x[u, a]] += cost * cnt * nmicros
            continue
        # pair variables with both marginals fixed: a tight linearisation of x[u, a] * x[v, b]
        y = {}
        for a in range(len(cu)):
            for b in range(len(cv)):
                if math.isinf(mat[a][b]):
                    continue
                y[a, b] = pulp.LpVariable(f"y_{nvars_y}", lowBound=0)
                nvars_y += 1
                if mat[a][b] > 0:
                    objective[y[a, b]] += mat[a][b] * cnt * nmicros
        for a in range(len(cu)):
            prob += pulp.lpSum(y[a, b] for b in range(len(cv)) if (a, b) in y) == x[u, a]
        for b in range(len(cv)):
            prob += pulp.lpSum(y[a, b] for a in range(len(cu)) if (a, b) in y) == x[v, b]
    out_cost: dict[tuple[str, int], float] = {}
    for n in reps:  # graph outputs are returned whole
        node = index[n]
        for oi, o in enumerate(node.outputs):
            if o in outputs and graph.values[o].meta is not None:
                nbytes = ctx.value_bytes(graph, o)
                for a, c in enumerate(table[n].choices):
                    cost = reshard_time(c.outputs[oi], Replicate(), nbytes, ctx, False, False)
                    out_cost[(n, a)] = out_cost.get((n, a), 0.0) + cost
                    if math.isinf(cost):
                        prob += x[n, a] == 0
                    elif cost:
                        objective[x[n, a]] += cost * nmicros
    # one (variable, coefficient) list, not a sum of products: PuLP builds an expression per product
    # (a quarter of the 70B search went there); microseconds: second-scale coefficients sit below
    # solver tolerances
    prob += pulp.LpAffineExpression([(v, c * _US) for v, c in objective.items()])
    if mem_limit is not None:
        used = [
            (x[n, i], _weighted_memory(c, mem_weights) * folded.count[n])
            for n in reps
            for i, c in enumerate(table[n].choices)
        ]
        prob += pulp.LpAffineExpression(used) <= mem_limit
    build_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    if all(len(table[n].choices) == 1 for n in reps):  # a given plan: nothing to choose, only to check
        for var in prob.variables():
            var.varValue = 1.0
        feasible = all(c.valid(1e-9) for c in prob.constraints.values())
        status, solver_name = (1 if feasible else -1), "none (one choice per node)"
    else:
        lp_solver, solver_name = _solver(solver)
        status = prob.solve(lp_solver)
    solve_s = time.perf_counter() - t1
    if pulp.LpStatus[status] != "Optimal":
        raise _no_partition(ctx, mem_limit, pulp.LpStatus[status])
    pick = {n: max(range(len(table[n].choices)), key=lambda i: x[n, i].value() or 0.0) for n in reps}
    for u, oi, keys, cost in shared_terms:  # charge the shared all-reduce to the producer
        chosen = [table[v].choices[pick[v]] for _, _, v, _, _ in keys]
        slots = [k[3] for k in keys]
        if any(c.plan.is_split and isinstance(c.inputs[s], Replicate) for c, s in zip(chosen, slots)):
            if isinstance(table[u].choices[pick[u]].outputs[oi], Replicate):
                out_cost[(u, pick[u])] = out_cost.get((u, pick[u]), 0.0) + cost
    return _result(
        graph,
        folded,
        table,
        edges,
        edge_cost,
        out_cost,
        pick,
        ctx,
        {
            "binaries": len(x),
            "continuous": nvars_y,
            "constraints": prob.numConstraints(),
            "nodes": len(graph.nodes),
            "folded_nodes": len(reps),
            "build_seconds": build_s,
            "solve_seconds": solve_s,
            "solver": solver_name,
            "status": pulp.LpStatus[status],
        },
    )


def _no_partition(ctx: CostContext, mem_limit: float | None, status: str) -> PlanError:
    limit = "no memory limit" if mem_limit is None else f"{mem_limit / 1e9:.2f} GB per device"
    if mem_limit is not None and mem_limit <= 0:
        limit = (
            f"the memory left per device ({mem_limit / 1e9:.2f} GB once transient buffers and what a "
            "pipeline stage keeps are set aside: the device limit is smaller than they are)"
        )
    return PlanError(
        f"autodist found no partition over {ctx.ways} devices within {limit} (solver status "
        f"{status}): raise pas_config['mem_constraint'], use more devices, recompute "
        "(recompute_modules) or ZeRO (zero_stage)"
    )


def _weighted_memory(c: Choice, weights: tuple[float, float]) -> float:
    act = c.activation_bytes
    return (c.memory - act) * weights[0] + act * weights[1]


def _result(graph, folded, table, edges, edge_cost, out_cost, pick, ctx, stats) -> SpmdResult:
    rep_time = {n: table[n].choices[i].time + out_cost.get((n, i), 0.0) for n, i in pick.items()}
    rep_comm = {n: table[n].choices[i].comm + out_cost.get((n, i), 0.0) for n, i in pick.items()}
    for key, cnt in edges.items():  # charge resharding to the consumer (per instance)
        u, oi, v, slot, ref = key
        if key in edge_cost:
            c = edge_cost[key][pick[u]][pick[v]]
        else:
            meta = graph.values[ref].meta
            nbytes = ctx.value_bytes(graph, ref)
            ch = table[v].choices[pick[v]]
            src = Replicate() if oi == "input" else None
            c = reshard_time(src, ch.inputs[slot], nbytes, ctx, ch.plan.is_split, meta.requires_grad)
        share = c * cnt / folded.count[v]
        rep_time[v] += share
        rep_comm[v] += share
    plans, choice, node_time, node_comm, node_mem, node_sync = {}, {}, {}, {}, {}, {}
    for node in graph.nodes:
        r = folded.rep[node.name]
        ch = table[r].choices[pick[r]]
        plans[node.name], choice[node.name] = ch.plan, ch
        node_time[node.name], node_comm[node.name], node_mem[node.name] = rep_time[r], rep_comm[r], ch.memory
        node_sync[node.name] = ch.sync
    return SpmdResult(
        plans,
        choice,
        node_time,
        node_comm,
        node_mem,
        node_sync,
        sum(node_time.values()),
        sum(node_mem.values()),
        sum(node_sync.values()),
        ctx.ways,
        stats,
    )
