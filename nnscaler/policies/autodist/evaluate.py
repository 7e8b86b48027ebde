"""Cost a given plan (a loaded plan, or a standard recipe) with the same model the search uses."""

from __future__ import annotations

from dataclasses import replace

from nnscaler.graph.ir import Graph
from nnscaler.policies.autodist.candidate import Candidate
from nnscaler.policies.autodist.context import PlannerSetup, stage_context
from nnscaler.policies.autodist.layers import fold_layers
from nnscaler.policies.autodist.spmd import solve_spmd
from nnscaler.policies.autodist.step_time import (
    RECOMPUTE_FACTOR,
    flat_memory,
    flat_step,
    pipelined_step,
    stage_memory,
)
from nnscaler.policies.plan import REPLICATE, NodePlan, Plan

__all__ = ["evaluate_nodes", "evaluate_plan"]


def evaluate_nodes(
    graph: Graph,
    setup: PlannerSetup,
    nodes: dict[str, NodePlan],
    *,
    pp: int = 1,
    starts: list[int] | None = None,
    nmicros: int = 1,
    recompute: tuple[str, ...] = (),
    mesh: tuple[int, ...] = (),
    scheduler: str = "1f1b",
) -> Candidate:
    """The predicted step time and memory of per-node splits over plan_ngpus // pp devices per stage
    (`mesh`: the stage mesh of nodes with 2-D splits). `starts` may hold more stages than the pp device
    groups: v stages per group under `scheduler` '1f1b_interleaved' (or the V-shaped schedules)."""
    tp = setup.plan_ngpus // pp
    ctx = replace(stage_context(setup, tp), mesh=mesh)
    fixed = {n.name: nodes.get(n.name, REPLICATE) for n in graph.nodes}
    fixed = {k: (v if v.is_split else REPLICATE) for k, v in fixed.items()}
    fixed = {  # notes do not matter
        k: NodePlan(mesh_splits=v.mesh_splits) if v.mesh_splits else NodePlan(v.split, v.ways, v.blocks)
        for k, v in fixed.items()
    }
    folded = fold_layers(graph, setup.pivots)
    uniform = all(fixed[n] == fixed[r] for n, r in folded.rep.items())  # every layer split alike
    res = solve_spmd(
        graph,
        ctx,
        setup.memory,
        recompute=recompute,
        pivots=setup.pivots,
        solver=setup.solver,
        fixed=fixed,
        fold=uniform,
        nmicros=nmicros,
    )
    if pp == 1:
        step = flat_step(graph, setup, ctx, res.time, res.sync, nmicros, bool(recompute))
        return Candidate(
            1,
            tp,
            nmicros,
            bool(recompute),
            step.step,
            flat_memory(graph, setup, ctx, res, nmicros),
            res,
            recompute_paths=recompute,
        )
    factor = RECOMPUTE_FACTOR if recompute else 1.0
    starts = sorted(starts or [0])
    bounds = starts + [len(graph.nodes)]
    stage_times, acts, params, syncs = [], [], [], []
    for s in range(len(starts)):
        names = [graph.nodes[i].name for i in range(bounds[s], bounds[s + 1])]
        stage_times.append(sum(res.node_time[n] for n in names) * factor)
        act = sum(res.choice[n].activation_bytes for n in names)
        acts.append(act)
        params.append(sum(res.node_memory[n] for n in names) - act)
        syncs.append(sum(res.node_sync[n] for n in names))
    step = pipelined_step(
        graph, setup, ctx, stage_times, syncs, starts, pp, nmicros, bool(recompute), scheduler
    )
    memory = max(stage_memory(params, acts, scheduler, pp, nmicros))
    cand = Candidate(pp, tp, nmicros, bool(recompute), step.step, memory, res, starts, stage_times, recompute)
    cand.scheduler = scheduler
    cand.bubble_share = step.pipeline.bubble / step.step if step.step > 0 else 0.0
    return cand


def evaluate_plan(graph: Graph, setup: PlannerSetup, plan: Plan) -> Candidate:
    """Re-cost a Plan for the current shapes and cluster."""
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    if plan.pipeline is None:
        return evaluate_nodes(
            graph, setup, plan.nodes, nmicros=setup.nmicros or 1, recompute=plan.recompute, mesh=plan.mesh
        )
    p = plan.pipeline
    return evaluate_nodes(
        graph,
        setup,
        plan.nodes,
        pp=p.pp_size,
        starts=[index[s] for s in p.starts],
        nmicros=p.nmicros,
        recompute=plan.recompute,
        mesh=plan.mesh,
        scheduler=p.scheduler,
    )
