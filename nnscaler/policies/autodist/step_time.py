"""The whole-step time of a scored SPMD partition, with or without pipeline stages: compute per
micro-batch, the pipeline schedule's bubble and hops (pipeline_time.py), the data-parallel sync that
does not hide behind compute (overlap.py) and the costs of no op (context.fixed_costs). The search,
the evaluation of a given plan and the recipes all take their step from here."""

from __future__ import annotations

import math
from dataclasses import dataclass

from nnscaler.graph.ir import Graph
from nnscaler.policies.autodist.comm import send_recv
from nnscaler.policies.autodist.context import PlannerSetup, fixed_costs, local_weight_bytes, segment_input
from nnscaler.policies.autodist.cost import CostContext
from nnscaler.policies.autodist.layers import layer_instances
from nnscaler.policies.autodist.overlap import SyncExposure, exposed_sync
from nnscaler.policies.autodist.pipeline_time import (
    PipelineTiming,
    StageSplit,
    device_of_stage,
    pipeline_timing,
)

__all__ = ["RECOMPUTE_FACTOR", "StepTime", "flat_step", "flat_memory", "pipelined_step", "stage_memory"]

RECOMPUTE_FACTOR = 4.0 / 3.0
"""Recomputed modules run their forward twice: forward + backward = 3 forward units become 4."""


@dataclass(frozen=True)
class StepTime:
    """One step's time and its parts."""

    step: float
    compute: float
    """Seconds the slowest device computes (all micro-batches)."""
    sync: SyncExposure
    pipeline: PipelineTiming | None = None
    fixed: float = 0.0


def _sync_exposure(
    graph: Graph,
    setup: PlannerSetup,
    ctx: CostContext,
    sync: float,
    per_micro: float,
    recompute: bool,
    stages: int,
) -> SyncExposure:
    split = StageSplit.for_recompute(recompute)
    forward = per_micro * split.forward
    backward = per_micro * (split.input_grad + split.weight_grad)
    weight_bytes = local_weight_bytes(graph, ctx, stages)
    if setup.memory.zero_stage >= 3:  # gathered and reduced block by block (a layer, the embedding...)
        groups = max(1, math.ceil((len(layer_instances(graph, setup.pivots)[1]) + 2) / max(stages, 1)))
    else:  # the reducer's buckets
        groups = max(1, math.ceil(weight_bytes / max(setup.bucket_bytes, 1.0)))
    inter = setup.cluster.nodes > 1 and ctx.dp_link == setup.cluster.inter_node
    latency = setup.memory.grad_sync_latency(weight_bytes, ctx, weight_bytes / groups)  # each group's
    return exposed_sync(
        sync + latency,
        setup.memory.zero_stage,
        forward,
        backward,
        buckets=groups,
        layers=groups,
        inter_node=inter,
        model=setup.overlap,
    )


def flat_step(
    graph: Graph,
    setup: PlannerSetup,
    ctx: CostContext,
    time: float,
    sync: float,
    nmicros: int,
    recompute: bool,
) -> StepTime:
    """A step without pipeline stages: `time` seconds per micro-batch (forward + backward, before the
    recompute factor), `sync` seconds of gradient sync per step."""
    per_micro = time * (RECOMPUTE_FACTOR if recompute else 1.0)
    exposure = _sync_exposure(graph, setup, ctx, sync, per_micro, recompute, 1)
    fixed = fixed_costs(graph, setup, ctx, nmicros)
    compute = per_micro * nmicros
    return StepTime(compute + exposure.exposed + fixed, compute, exposure, None, fixed)


def pipelined_step(
    graph: Graph,
    setup: PlannerSetup,
    ctx: CostContext,
    stage_times: list[float],
    stage_syncs: list[float],
    starts: list[int],
    pp: int,
    nmicros: int,
    recompute: bool,
    scheduler: str = "1f1b",
) -> StepTime:
    """A pipelined step: `stage_times` (forward + backward of one micro-batch, recompute included) and
    `stage_syncs` (gradient sync seconds) per stage starting at node index `starts`, over `pp` device
    groups under `scheduler`."""
    hop_bytes = max((segment_input(graph, ctx, i) for i in starts[1:]), default=0.0)
    hop = send_recv(hop_bytes, 2, setup.cluster.link(2, ctx.ways))
    split = StageSplit.for_recompute(recompute)
    timing = pipeline_timing(scheduler, stage_times, pp, nmicros, hop, split)
    per_device_time = [0.0] * pp
    per_device_sync = [0.0] * pp
    for s, (t, y) in enumerate(zip(stage_times, stage_syncs)):
        d = device_of_stage(scheduler, s, pp)
        per_device_time[d] += t
        per_device_sync[d] += y
    exposures = [
        _sync_exposure(graph, setup, ctx, y, t, recompute, len(starts))
        for t, y in zip(per_device_time, per_device_sync)
    ]
    exposure = max(exposures, key=lambda e: e.exposed)
    fixed = fixed_costs(graph, setup, ctx, nmicros, len(starts))
    return StepTime(timing.step + exposure.exposed + fixed, timing.busy, exposure, timing, fixed)


def stage_memory(
    stage_params: list[float], stage_acts: list[float], scheduler: str, pp: int, nmicros: int
) -> list[float]:
    """Bytes per device group: its stages' parameters and state, and their activations times the
    micro-batches the schedule keeps in flight on it (pipeline_time.PipelineTiming.inflight)."""
    inflight = pipeline_timing(scheduler, [0.0] * len(stage_params), pp, nmicros).inflight
    params, acts = [0.0] * pp, [0.0] * pp
    for s, (p, a) in enumerate(zip(stage_params, stage_acts)):
        d = device_of_stage(scheduler, s, pp)
        params[d] += p
        acts[d] += a
    return [p + a * k for p, a, k in zip(params, acts, inflight)]


def flat_memory(graph: Graph, setup: PlannerSetup, ctx: CostContext, res, nmicros: int) -> float:
    """Peak bytes per device of an SPMD result without pipeline stages: every node's state and saved
    activations, where gradients that do not outlive backward (MemoryModel.grads_outlive_backward)
    appear as backward frees the activations instead of adding to them (MemoryModel.backward_live_peak)."""
    memory = setup.memory
    if memory.grads_outlive_backward(ctx, nmicros, pipelined=False) or not ctx.training:
        return res.memory
    choices = [res.choice[n.name] for n in graph.nodes]
    acts = [c.activation_bytes * memory.activation_factor for c in choices]
    grads = [memory.param_state_parts(c.param_bytes, ctx)["gradients"] for c in choices]
    parts = memory.param_state_parts(sum(c.param_bytes for c in choices), ctx)
    total = sum(parts.values()) + sum(acts)
    peak = memory.peak_state(parts, sum(acts), False, memory.backward_live_peak(acts, grads))
    return res.memory - (total - peak)
