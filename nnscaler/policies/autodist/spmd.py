"""SPMD search: one partition per node, minimising compute + resharding + gradient-sync time under a
per-device memory limit, as an integer program (PuLP; CBC, or HiGHS where installed).

Variables: x[n, c] = 1 when node n takes choice c (one per node). For an edge (a value produced by
u, read by v) whose cost depends on both choices, y[e, a, b] in [0, 1] carries the pair (a, b): its
sums over b equal x[u, a] and over a equal x[v, b] (a tight linearisation of x[u, a] * x[v, b];
forbidden pairs get no variable), and its coefficient is the resharding time of the pair. A value read
whole by several split readers pays one backward all-reduce (z in [0, 1], at least every such reader's
x). Repeated layers are folded onto one (layers.py): a representative's terms are weighted by the
number of nodes it stands for, and edges between consecutive layers become edges of the
representative onto itself.

spmd_problem.py gathers the choices and edges, spmd_program.py builds the program; this module solves
it and decodes the chosen partitions and their predicted costs.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field, replace

import pulp

from nnscaler.errors import PlanError
from nnscaler.graph.ir import Graph, Replicate
from nnscaler.policies.autodist.choices import Choice
from nnscaler.policies.autodist.constraints import PartitionConstraints
from nnscaler.policies.autodist.cost import CostContext, reshard_time
from nnscaler.policies.autodist.memo import context_key, solution_cache
from nnscaler.policies.autodist.memory import MemoryModel
from nnscaler.policies.autodist.spmd_problem import (
    SpmdProblem,
    build_problem,
    no_partition_error,
    weighted_memory,
)
from nnscaler.policies.autodist.spmd_program import SpmdProgram, build_program
from nnscaler.policies.plan import NodePlan

__all__ = ["SpmdResult", "solve_spmd", "available_solvers", "decode_choices", "NOT_CHEAPER"]

NOT_CHEAPER = "no cheaper"
"""SpmdResult.stats['meshes'] of a mesh whose program was stopped at the best mesh's objective (it
could not win; or it does not fit)."""


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
    """ILP size and solve time: variables, constraints, nodes, seconds, solver, status, objective (and
    'meshes': mesh ('2x4') -> objective of each mesh tried, None where infeasible, NOT_CHEAPER where
    stopped at the best one's objective)."""
    mesh: tuple[int, ...] = ()
    """The mesh of the nodes with 2-D splits (() when none has one)."""

    def step_time(self, nmicros: int = 1) -> float:
        """Seconds per step of `nmicros` micro-batches run one after the other (gradient accumulation)."""
        return self.time * nmicros + self.sync


def available_solvers() -> list[str]:
    names = pulp.listSolvers(onlyAvailable=True)
    return [n for n, s in (("highs", "HiGHS"), ("cbc", "PULP_CBC_CMD")) if s in names]


def _solver(name: str, cutoff: float | None = None):
    """CBC by default: on these programs it solved as fast as HiGHS or faster, folded or not; 'highs'
    where installed on request. `cutoff` (CBC): only solutions with a smaller objective count (the
    program is 'Infeasible' without one): a mesh's program that cannot beat the best mesh so far
    stops at its first bound above it (Llama-3-8B's 3-axis mesh: 1 s to 0.15 s)."""
    if name == "highs" and "HiGHS" in pulp.listSolvers(onlyAvailable=True):
        return pulp.HiGHS(msg=False), "highs"
    options = [f"cutoff {cutoff!r}"] if cutoff is not None else []
    return pulp.PULP_CBC_CMD(msg=False, threads=1, options=options), "cbc"


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

    ctx.mesh_options of two or more meshes (and no `fixed`): each mesh's program is solved and the
    cheapest feasible one taken (its mesh in SpmdResult.mesh).
    """
    kwargs = dict(
        constraints=constraints,
        mem_limit=mem_limit,
        recompute=recompute,
        pivots=pivots,
        fold=fold,
        solver=solver,
        fixed=fixed,
        nmicros=nmicros,
        mem_weights=mem_weights,
    )
    if fixed is not None or len(ctx.mesh_options) < 2:
        return _solve_one(graph, ctx, memory, **kwargs)
    return _solve_meshes(graph, ctx, memory, kwargs)


def _solve_meshes(graph: Graph, ctx: CostContext, memory: MemoryModel | None, kwargs: dict) -> SpmdResult:
    """The cheapest of the programs of ctx.mesh_options (by objective: seconds per step)."""
    best: SpmdResult | None = None
    error: PlanError | None = None
    tried: dict[str, float | None] = {}
    for mesh in ctx.mesh_options:
        name = "x".join(map(str, mesh))
        cutoff = None if best is None else best.stats["objective"]
        try:
            res = _solve_one(graph, replace(ctx, mesh=mesh, mesh_options=()), memory, cutoff=cutoff, **kwargs)
        except PlanError as exc:  # infeasible, or (under a cutoff) no cheaper than the best mesh so far
            error, tried[name] = error or exc, None if cutoff is None else NOT_CHEAPER
            continue
        tried[name] = res.stats["objective"]
        if best is None or res.stats["objective"] < best.stats["objective"] - 1e-9:
            best = res
    if best is None:
        raise error
    best.stats["meshes"] = tried
    return best


def _solve_one(
    graph: Graph,
    ctx: CostContext,
    memory: MemoryModel | None,
    *,
    constraints,
    mem_limit,
    recompute,
    pivots,
    fold,
    solver,
    fixed,
    nmicros,
    mem_weights,
    cutoff: float | None = None,
) -> SpmdResult:
    """solve_spmd over ctx.mesh alone. The solution of a program solved before (the same choices,
    edges, limit and micro-batches: offline planning meets one under several ZeRO stages, plan sizes
    and cp degrees) is the one found then (memo.solution_cache)."""
    memory = memory or MemoryModel()
    args = (constraints, recompute, pivots, fold, nmicros)
    problem = _problem(graph, ctx, memory, args, fixed, mem_limit, mem_weights)
    cache = solution_cache(graph, "spmd_solutions") if fixed is None else None
    key = _program_key(problem, solver, cutoff) if cache is not None else None
    if key in (cache or {}):
        return _cached(cache[key])
    try:
        res = _solve_problem(problem, ctx, mem_limit, solver, cutoff)
    except PlanError as exc:
        if cache is not None:
            cache[key] = exc
        raise
    if cache is not None:
        cache[key] = res
    return res


def _cached(hit: SpmdResult | PlanError) -> SpmdResult:
    """A cached solution (its stats copied: _solve_meshes adds to them), or its error raised again."""
    if isinstance(hit, PlanError):
        raise hit
    return replace(hit, stats=dict(hit.stats))


def _problem(graph, ctx, memory, args: tuple, fixed, mem_limit, mem_weights) -> SpmdProblem:
    """build_problem's problem; its choices and edges once per (context, memory model, constraints,
    recompute, pivots, fold, micro-batches) of a graph, the limit and weights set on each call (a
    pipeline stage's program is built with and without recompute's weights)."""
    constraints, recompute, pivots, fold, nmicros = args
    kwargs = dict(constraints=constraints, recompute=recompute, pivots=pivots, fold=fold, nmicros=nmicros)
    cache = solution_cache(graph, "spmd_problems") if fixed is None else None
    if cache is None:
        return _build(graph, ctx, memory, fixed=fixed, mem_limit=mem_limit, mem_weights=mem_weights, **kwargs)
    key = (context_key(ctx), memory, *args)
    if key not in cache:
        cache[key] = _build(graph, ctx, memory, fixed=None, mem_limit=None, mem_weights=(1.0, 1.0), **kwargs)
    base = cache[key]
    if mem_limit is not None:  # build_problem's check: the leanest choices over the limit, no program
        least = sum(
            min(weighted_memory(c, mem_weights) for c in base.table[n].choices) * base.folded.count[n]
            for n in base.reps
        )
        if least > mem_limit:
            raise no_partition_error(ctx, mem_limit, "Infeasible")
    return replace(base, mem_limit=mem_limit, mem_weights=mem_weights)


def _build(graph, ctx, memory, **kwargs) -> SpmdProblem:
    with warnings.catch_warnings():  # PuLP 3.3 announces PuLP 4's API changes on every variable
        warnings.simplefilter("ignore", DeprecationWarning)
        return build_problem(graph, ctx, memory, **kwargs)


def _program_key(problem: SpmdProblem, solver: str, cutoff: float | None) -> tuple:
    """Everything the integer program of `problem` is made of: the cost context (edge costs), every
    representative's choices (their costs and memory) and count, the edges, the limit and weights,
    micro-batches; two problems with equal keys are the same program."""
    table = tuple(
        (n, problem.folded.count[n], tuple(problem.table[n].choices), tuple(problem.table[n].refs))
        for n in problem.reps
    )
    edges = tuple(problem.edges.items())
    return (
        context_key(problem.ctx),
        table,
        edges,
        problem.mem_limit,
        problem.mem_weights,
        problem.nmicros,
        solver,
        cutoff,
    )


def _solve_problem(
    problem: SpmdProblem, ctx: CostContext, mem_limit: float | None, solver: str, cutoff: float | None
) -> SpmdResult:
    """Build the program of `problem`, solve it and decode the solution."""
    graph = problem.graph
    with warnings.catch_warnings():  # PuLP 3.3 announces PuLP 4's API changes on every variable
        warnings.simplefilter("ignore", DeprecationWarning)
        t0 = time.perf_counter()
        program = build_program(problem)
        build_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        status, solver_name = _run(problem, program, solver, cutoff)
        solve_s = time.perf_counter() - t1
        if status != "Optimal":
            raise no_partition_error(ctx, mem_limit, status)
        pick, out_cost = decode_choices(problem, program)
        stats = {
            "binaries": len(program.x),
            "continuous": program.continuous,
            "constraints": program.prob.numConstraints(),
            "nodes": len(graph.nodes),
            "folded_nodes": len(problem.reps),
            "build_seconds": build_s,
            "solve_seconds": solve_s,
            "solver": solver_name,
            "status": status,
            "objective": pulp.value(program.prob.objective) or 0.0,
        }
        return _result(problem, program, pick, out_cost, stats)


def _run(
    problem: SpmdProblem, program: SpmdProgram, solver: str, cutoff: float | None = None
) -> tuple[str, str]:
    """(PuLP status name, solver name). With one choice per node (a given plan) there is nothing to
    choose, only constraints to check."""
    prob = program.prob
    if all(len(problem.table[n].choices) == 1 for n in problem.reps):
        for var in prob.variables():
            var.varValue = 1.0
        feasible = all(c.valid(1e-9) for c in prob.constraints.values())
        return pulp.LpStatus[1 if feasible else -1], "none (one choice per node)"
    lp_solver, solver_name = _solver(solver, cutoff)
    return pulp.LpStatus[prob.solve(lp_solver)], solver_name


def decode_choices(
    problem: SpmdProblem, program: SpmdProgram
) -> tuple[dict[str, int], dict[tuple[str, int], float]]:
    """From a solved program: (representative -> index of its choice, (representative, choice index) ->
    seconds of its output communication, each shared all-reduce charged to the value's producer)."""
    table, x = problem.table, program.x
    pick = {n: max(range(len(table[n].choices)), key=lambda i: x[n, i].value() or 0.0) for n in problem.reps}
    out_cost = dict(program.out_cost)
    for term in program.shared:
        u, oi = term.producer, term.output
        chosen = [table[v].choices[pick[v]] for _, _, v, _, _ in term.readers]
        slots = [k[3] for k in term.readers]
        if any(c.plan.is_split and isinstance(c.inputs[s], Replicate) for c, s in zip(chosen, slots)):
            if isinstance(table[u].choices[pick[u]].outputs[oi], Replicate):
                out_cost[(u, pick[u])] = out_cost.get((u, pick[u]), 0.0) + term.cost
    return pick, out_cost


def _result(
    problem: SpmdProblem,
    program: SpmdProgram,
    pick: dict[str, int],
    out_cost: dict[tuple[str, int], float],
    stats: dict,
) -> SpmdResult:
    """Per-node times (resharding charged to the consumer, per instance), memory and sync of `pick`."""
    graph, ctx, table, folded = problem.graph, problem.ctx, problem.table, problem.folded
    rep_time = {n: table[n].choices[i].time + out_cost.get((n, i), 0.0) for n, i in pick.items()}
    rep_comm = {n: table[n].choices[i].comm + out_cost.get((n, i), 0.0) for n, i in pick.items()}
    for key, cnt in problem.edges.items():
        u, oi, v, slot, ref = key
        if key in program.edge_cost:
            c = program.edge_cost[key][pick[u]][pick[v]]
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
        ctx.mesh if any(p.mesh_splits for p in plans.values()) else (),
    )
