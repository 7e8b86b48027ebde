"""Expert parallelism in the search: every ep degree dividing a stage's devices and every MoE layer's
experts (only for models with experts ops; others plan as before).

For each degree the inner search (context parallelism, tp mesh x pipeline x recompute x
micro-batches) plans the devices left over, `plan_ngpus / ep`, as the per-rank problem
(`ep_setup`): 1/ep of the tokens (batch_scale), weights replicated over ep x dp, but the experts
ops' weights 1/ep per rank and reduced over dp only (its ep_degree, CostContext.experts_context); the
all-to-alls are added to each configuration it scores (autodist/expert_parallel.py). The winner's Plan
is the tp plan of the remaining devices composed with the ep axis (policies/expert_parallel.py).
Expert and context parallelism are not combined (policy tp refuses both): degrees > 1 plan cp = 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from nnscaler.errors import PlanError
from nnscaler.graph.ir import Graph
from nnscaler.graph.ops import annotate_node
from nnscaler.policies.autodist.candidate import Candidate
from nnscaler.policies.autodist.context import PlannerSetup, stage_context
from nnscaler.policies.autodist.evaluate import evaluate_plan
from nnscaler.policies.autodist.expert_parallel import ep_cost, moe_layers
from nnscaler.policies.autodist.memo import graph_memo
from nnscaler.policies.expert_parallel import (
    check_ep_size,
    check_expert_parallel,
    experts_nodes,
    token_plans,
    with_expert_parallel,
)
from nnscaler.policies.plan import REPLICATE, ContextParallel, NodePlan, Plan

__all__ = [
    "EP_NOT_TAKEN",
    "ep_setup",
    "ep_search",
    "cost_with_ep",
    "plan_ep_degree",
    "ep_tp_part",
    "with_ep",
    "evaluate_ep_plan",
]

EP_NOT_TAKEN = "autodist: ep not taken: "
"""Prefix of the plan notes that say why an expert-parallel degree was not taken (report_ep.py)."""

Search = Callable[[Graph, PlannerSetup], tuple[Candidate, list[Candidate]]]


def ep_setup(setup: PlannerSetup, ep: int) -> PlannerSetup:
    """The per-rank problem of ep degree `ep`: plan_ngpus / ep devices, 1/ep of the tokens, weights'
    gradients reduced over ep x dp replicas, no context parallelism; under tp_mesh 'auto' the tp devices
    beside ep stay 1-D (the stage mesh is (ep, tp))."""
    if ep == 1:
        return replace(setup, ep_size=1)
    return replace(
        setup,
        plan_ngpus=setup.plan_ngpus // ep,
        dp_size=setup.dp_size * ep,
        batch_scale=setup.batch_scale / ep,
        cp_size=1,
        ep_size=1,
        ep_degree=ep,
        tp_mesh="off" if setup.tp_mesh == "auto" else setup.tp_mesh,
    )


def _token_split(graph: Graph, ep: int) -> str | None:
    """Why the experts cannot receive their tokens split `ep` ways by the batch (None: they can)."""
    memo = graph_memo(graph).setdefault("ep_token_plans", {})
    if ep not in memo:
        try:
            token_plans(graph, ep)
            memo[ep] = None
        except PlanError as exc:
            memo[ep] = str(exc)
    return memo[ep]


def _pinned(graph: Graph, setup: PlannerSetup, ep: int) -> list[int]:
    """A pinned ep_size, checked as policy tp checks it (same errors)."""
    cp = ContextParallel(setup.cp_size) if setup.cp_size not in (None, 1) else None
    check_ep_size(ep, setup.plan_ngpus, cp, "autodist")
    check_expert_parallel(graph, ep)
    why = _token_split(graph, ep)
    if why:
        raise PlanError(f"autodist: pas_config['ep_size']={ep} cannot be planned: {why}")
    if isinstance(setup.tp_mesh, tuple) and len(setup.tp_mesh) == 3:
        raise PlanError(
            f"autodist: pas_config['ep_size']={ep} with a 3-axis tp_mesh would make a 4-axis mesh; pin a "
            "2-axis tp_mesh or none"
        )
    return [ep]


def _degrees(graph: Graph, setup: PlannerSetup) -> tuple[list[int], list[tuple[str, str]]]:
    """ep degrees to search and (degree, why not) for the others; PlanError for a pin that cannot hold."""
    n, pinned = setup.plan_ngpus, setup.ep_size
    if pinned == 1:
        return [1], []
    if pinned is not None:
        return _pinned(graph, setup, pinned), []
    nodes = experts_nodes(graph)
    if not nodes or n == 1:
        return [1], []
    if setup.cp_size not in (None, 1):
        return [1], [
            ("ep>1", "pas_config['cp_size'] pins context parallelism, which ep does not go with yet")
        ]
    if isinstance(setup.tp_mesh, tuple):
        return [1], [("ep>1", "pas_config['tp_mesh'] pins the mesh of a stage's devices; give ep_size too")]
    experts = sorted({annotate_node(node, graph).sizes["e"] for node in nodes})
    degrees, rejected = [1], []
    for ep in (d for d in range(2, n + 1) if n % d == 0):
        bad = [e for e in experts if e % ep]
        why = f"{ep} does not divide the {bad[0]} experts of a layer" if bad else _token_split(graph, ep)
        if why:
            rejected.append((f"ep={ep}", why))
        else:
            degrees.append(ep)
    return degrees, rejected


def cost_with_ep(graph: Graph, sub: PlannerSetup, cand: Candidate, ep: int) -> Candidate:
    """`cand` (a configuration of the per-rank problem `sub`, whose experts' memory and sync already
    hold ep) with ep's all-to-alls added."""
    if ep == 1:
        return replace(cand)
    ctx = stage_context(sub, cand.tp, pipelined=cand.pp > 1)
    cost = ep_cost(moe_layers(graph, ctx), ep, cand.tp, sub.cluster, (cand.nmicros, cand.pp, cand.recompute))
    return replace(cand, ep=ep, step_time=cand.step_time + cost.comm, ep_bytes=cost.bytes, ep_comm=cost.comm)


def _order(c: Candidate) -> tuple:
    return (c.time_per_micro, c.pp, c.cp_size, c.ep, -c.tp, c.recompute)


def ep_search(graph: Graph, setup: PlannerSetup, inner: Search) -> tuple[Candidate, list[Candidate]]:
    """The best configuration over ep degrees (`inner`: the search of one per-rank problem)."""
    degrees, rejected = _degrees(graph, setup)
    if degrees == [1] and not rejected:
        return inner(graph, replace(setup, ep_size=1))
    scored: list[Candidate] = []
    best_of: dict[int, Candidate] = {}
    errors: list[PlanError] = []
    for ep in degrees:
        sub = ep_setup(setup, ep)
        try:
            _, found = inner(graph, sub)
        except PlanError as exc:
            errors.append(exc)
            why = " ".join(line.strip() for line in str(exc).removeprefix("autodist: ").splitlines())
            rejected.append((f"ep={ep}", why[:400]))
            continue
        costed = [cost_with_ep(graph, sub, x, ep) for x in found]
        fits = [x for x in costed if x.memory <= setup.mem_limit] or costed
        scored += costed
        best_of[ep] = min(fits, key=_order)
    if not scored:
        raise _nothing_planned(errors, rejected)
    best = min(best_of.values(), key=_order)
    best.ep_rejected = tuple(_slower(best, best_of)) + tuple(rejected)
    return best, scored


def _nothing_planned(errors: list[PlanError], rejected: list[tuple[str, str]]) -> PlanError:
    """The first degree's error, then one line per expert-parallel degree and why it was not planned."""
    lines = "\n".join(f"  - {key}: {why[:300]}" for key, why in rejected)
    head = str(errors[0]) if errors else "autodist: no expert-parallel degree could be planned"
    return PlanError(f"{head}\nper expert-parallel degree:\n{lines}")


def _slower(best: Candidate, best_of: dict[int, Candidate]) -> list[tuple[str, str]]:
    """(degree, why not taken) for the best candidate of every other ep degree."""
    out = []
    for ep, x in sorted(best_of.items()):
        if x is best:
            continue
        gap = x.time_per_micro - best.time_per_micro
        why = f"predicted {x.step_time * 1e3:.3f} ms per step ({x.label()}), {gap * x.nmicros * 1e3:+.3f} ms"
        if ep == 1 and x.tp > 1:
            why += f": without expert parallelism the experts are split by tp={x.tp} on their intermediate "
            why += "features (every token on every tp rank, the layer's output all-reduced over them)"
        elif ep == 1:
            why += ": without expert parallelism every rank keeps every expert, their gradients reduced "
            why += "over every replica"
        elif x.ep_comm > 0:
            why += f": its all-to-alls take {x.ep_comm * 1e3:.3f} ms per step"
        out.append((f"ep={ep}", why))
    return out


def with_ep(graph: Graph, plan: Plan, cand: Candidate) -> Plan:
    """The plan of an ep candidate: its tp plan composed with the ep axis, why-not notes added."""
    if cand.ep > 1:
        plan = with_expert_parallel(graph, plan, cand.ep)
    notes = tuple(f"{EP_NOT_TAKEN}{key}: {why}" for key, why in cand.ep_rejected)
    return replace(plan, notes=plan.notes + notes)


def plan_ep_degree(graph: Graph, plan: Plan) -> int:
    """The plan's expert-parallel degree (1: the experts are not split on `e`)."""
    for node in experts_nodes(graph):
        p = plan.node(node.name)
        if p.mesh_splits and p.mesh_splits[0][0] == "e":
            return plan.mesh[0]
        if not p.mesh_splits and p.split == "e":
            return p.ways
    return 1


def ep_tp_part(plan: Plan, ep: int) -> Plan:
    """An ep (or cp) plan's tensor-parallel part over the devices left to it (mesh axis 0, `ep` ways, dropped)."""
    if not plan.mesh:
        return Plan(plan.policy, plan.plan_ngpus // ep, {}, plan.notes, plan.recompute, plan.pipeline)
    rest = plan.mesh[1:]
    nodes = {}
    for name, p in plan.nodes.items():
        splits = p.mesh_splits[1:] if p.mesh_splits else ()
        if not any(ident for ident, _ in splits):
            nodes[name] = REPLICATE
        elif len(rest) == 1:
            nodes[name] = NodePlan(splits[0][0], rest[0], splits[0][1])
        else:
            nodes[name] = NodePlan(mesh_splits=splits)
    mesh = rest if len(rest) > 1 else ()
    return Plan(plan.policy, plan.plan_ngpus // ep, nodes, plan.notes, plan.recompute, plan.pipeline, mesh)


def evaluate_ep_plan(graph: Graph, setup: PlannerSetup, plan: Plan, ep: int) -> Candidate:
    """Re-cost a plan with expert parallelism: its tp part as the per-rank problem, plus the ep cost."""
    sub = ep_setup(setup, ep)
    cand = evaluate_plan(graph, sub, ep_tp_part(plan, ep))
    return cost_with_ep(graph, sub, cand, ep)
