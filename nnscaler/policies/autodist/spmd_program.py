"""The PuLP program of an SpmdProblem (the formulation is in spmd.py's docstring).

Costs are seconds per step, scaled to microseconds in the objective: second-scale coefficients sit below
the solvers' tolerances."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import pulp

from nnscaler.graph.ir import Replicate
from nnscaler.policies.autodist.comm import all_reduce
from nnscaler.policies.autodist.cost import reshard_time
from nnscaler.policies.autodist.memo import context_key, solution_cache
from nnscaler.policies.autodist.spmd_problem import Edge, SpmdProblem, weighted_memory

__all__ = ["SharedReduce", "SpmdProgram", "build_program"]

_US = 1e6
"""The objective is scaled to microseconds."""
_EPS_SPLIT = 1e-9
"""A tie-breaker: between equally fast choices prefer replication (fewer splits, simpler code)."""


@dataclass(frozen=True)
class SharedReduce:
    """One backward all-reduce shared by every split reader of a replicated value."""

    producer: str
    output: int
    readers: list[Edge]
    cost: float
    """Seconds of one all-reduce."""


@dataclass
class SpmdProgram:
    """The program and the costs that decoding its solution charges to nodes."""

    prob: pulp.LpProblem
    x: dict[tuple[str, int], pulp.LpVariable]
    """(representative, choice index) -> 1 when the representative takes that choice."""
    objective: dict[pulp.LpVariable, float] = field(default_factory=lambda: defaultdict(float))
    """Variable -> seconds per step."""
    edge_cost: dict[Edge, list[list[float]]] = field(default_factory=dict)
    """Edge between two representatives -> resharding seconds of every (producer, consumer) choice pair."""
    out_cost: dict[tuple[str, int], float] = field(default_factory=dict)
    """(representative, choice index) -> seconds of returning its graph outputs whole."""
    shared: list[SharedReduce] = field(default_factory=list)
    continuous: int = 0
    """Continuous variables made so far (they are numbered in one sequence)."""

    def continuous_var(self, prefix: str, up: float | None = None) -> pulp.LpVariable:
        var = pulp.LpVariable(f"{prefix}_{self.continuous}", lowBound=0, upBound=up)
        self.continuous += 1
        return var


def build_program(p: SpmdProblem) -> SpmdProgram:
    """The integer program of `p`: one choice per representative, the cheapest step within the memory
    limit."""
    prog = _choice_variables(p)
    readers: dict[tuple, list[Edge]] = defaultdict(list)
    for key in p.edges:
        if key[0] is not None:
            readers[key[0], key[1]].append(key)
    shared = {k: keys for k, keys in readers.items() if len({(e[2], e[3]) for e in keys}) > 1}
    for (u, oi), keys in shared.items():
        _shared_reduce(p, prog, u, oi, keys)
    for key, cnt in p.edges.items():
        if key[0] is None:
            _input_edge(p, prog, key, cnt)
        else:
            _pair_edge(p, prog, key, cnt, (key[0], key[1]) in shared)
    _output_terms(p, prog)
    # one (variable, coefficient) list, not a sum of products: PuLP builds an expression per product
    prog.prob += pulp.LpAffineExpression([(v, c * _US) for v, c in prog.objective.items()])
    if p.mem_limit is not None:
        used = [
            (prog.x[n, i], weighted_memory(c, p.mem_weights) * p.folded.count[n])
            for n in p.reps
            for i, c in enumerate(p.table[n].choices)
        ]
        prog.prob += pulp.LpAffineExpression(used) <= p.mem_limit
    return prog


def _choice_variables(p: SpmdProblem) -> SpmdProgram:
    """x[n, c], one choice per representative, and each choice's own time (+ the split tie-breaker)."""
    prob = pulp.LpProblem("spmd", pulp.LpMinimize)
    x = {
        (n, i): pulp.LpVariable(f"x_{k}_{i}", cat="Binary")
        for k, n in enumerate(p.reps)
        for i in range(len(p.table[n].choices))
    }
    prog = SpmdProgram(prob, x)
    for n in p.reps:
        prob += pulp.lpSum(x[n, i] for i in range(len(p.table[n].choices))) == 1
        cnt = p.folded.count[n]
        for i, c in enumerate(p.table[n].choices):
            per_step = c.time * p.nmicros + c.sync
            prog.objective[x[n, i]] += (per_step + (_EPS_SPLIT if c.plan.is_split else 0.0)) * cnt
    return prog


def _shared_reduce(p: SpmdProblem, prog: SpmdProgram, u: str, oi: int, keys: list[Edge]) -> None:
    """One backward all-reduce for all split readers of a replicated value: z >= every reader's split
    choice that takes the value whole."""
    ref = keys[0][4]
    meta = p.graph.values[ref].meta
    ctx = p.ctx
    if not (ctx.training and meta.requires_grad and ctx.ways > 1):
        return
    z = prog.continuous_var("z", up=1)
    for _, _, v, slot, _ in keys:
        for b, c in enumerate(p.table[v].choices):
            if c.plan.is_split and isinstance(c.inputs[slot], Replicate):
                prog.prob += z >= prog.x[v, b]
    cost = all_reduce(ctx.value_bytes(p.graph, ref), ctx.ways, ctx.tp_link)
    prog.objective[z] += cost * max(p.edges[k] for k in keys) * p.nmicros
    prog.shared.append(SharedReduce(u, oi, keys, cost))


def _input_edge(p: SpmdProblem, prog: SpmdProgram, key: Edge, cnt: int) -> None:
    """A value with no producer in the graph (an input, a parameter): the consumer's resharding."""
    _, kind, v, slot, ref = key
    meta = p.graph.values[ref].meta
    nbytes = p.ctx.value_bytes(p.graph, ref)
    src = Replicate() if kind == "input" else None
    for b, c in enumerate(p.table[v].choices):
        cost = reshard_time(src, c.inputs[slot], nbytes, p.ctx, c.plan.is_split, meta.requires_grad)
        if math.isinf(cost):
            prog.prob += prog.x[v, b] == 0
        elif cost:
            prog.objective[prog.x[v, b]] += cost * cnt * p.nmicros


def _pair_edge(p: SpmdProblem, prog: SpmdProgram, key: Edge, cnt: int, shared: bool) -> None:
    """A value from representative u to v: resharding time per choice pair; forbidden pairs excluded."""
    u, oi, v, slot, ref = key
    cu, cv = p.table[u].choices, p.table[v].choices
    mat = _pair_costs(p, key, shared)
    prog.edge_cost[key] = mat
    x = prog.x
    if len(cu) == 1 or len(cv) == 1:  # one side fixed: the cost falls on the other side's choice
        for a in range(len(cu)):
            for b in range(len(cv)):
                cost = mat[a][b]
                if math.isinf(cost):
                    prog.prob += x[u, a] + x[v, b] <= 1
                elif cost > 0:
                    prog.objective[x[v, b] if len(cu) == 1 else x[u, a]] += cost * cnt * p.nmicros
        return
    # pair variables with both marginals fixed: a tight linearisation of x[u, a] * x[v, b]
    y = {}
    for a in range(len(cu)):
        for b in range(len(cv)):
            if math.isinf(mat[a][b]):
                continue
            y[a, b] = prog.continuous_var("y")
            if mat[a][b] > 0:
                prog.objective[y[a, b]] += mat[a][b] * cnt * p.nmicros
    for a in range(len(cu)):
        prog.prob += pulp.lpSum(y[a, b] for b in range(len(cv)) if (a, b) in y) == x[u, a]
    for b in range(len(cv)):
        prog.prob += pulp.lpSum(y[a, b] for a in range(len(cu)) if (a, b) in y) == x[v, b]


def _pair_costs(p: SpmdProblem, key: Edge, shared: bool) -> list[list[float]]:
    """Resharding seconds of every (producer choice, consumer choice) pair of edge `key`; once per graph,
    cost context and layouts (the ZeRO stages of one plan size meet the same matrices: only memory and
    sync set their choices apart)."""
    u, oi, v, slot, ref = key
    ctx, meta = p.ctx, p.graph.values[ref].meta
    nbytes = ctx.value_bytes(p.graph, ref)
    cu, cv = p.table[u].choices, p.table[v].choices
    outs = tuple(a.outputs[oi] for a in cu)
    ins = tuple((c.inputs[slot], c.plan.is_split) for c in cv)
    cache = solution_cache(p.graph, "reshard_costs")
    ck = (context_key(ctx), ref, shared, outs, ins)
    if cache is not None and ck in cache:
        return cache[ck]
    mat = [
        [reshard_time(out, dst, nbytes, ctx, split, meta.requires_grad, shared) for dst, split in ins]
        for out in outs
    ]
    if cache is not None:
        cache[ck] = mat
    return mat


def _output_terms(p: SpmdProblem, prog: SpmdProgram) -> None:
    """Graph outputs are returned whole: each producer choice pays gathering them."""
    outputs = set(p.graph.output_names())
    index = {n.name: n for n in p.graph.nodes}
    for n in p.reps:
        for oi, o in enumerate(index[n].outputs):
            if o not in outputs or p.graph.values[o].meta is None:
                continue
            nbytes = p.ctx.value_bytes(p.graph, o)
            for a, c in enumerate(p.table[n].choices):
                cost = reshard_time(c.outputs[oi], Replicate(), nbytes, p.ctx, False, False)
                prog.out_cost[(n, a)] = prog.out_cost.get((n, a), 0.0) + cost
                if math.isinf(cost):
                    prog.prob += prog.x[n, a] == 0
                elif cost:
                    prog.objective[prog.x[n, a]] += cost * p.nmicros
