"""The planner's inputs (PlannerSetup) and what every scorer (search.py, evaluate.py, recipes.py)
derives from them: the cost context of a stage, its transient memory, the costs that belong to no op,
and the bytes that enter a pipeline segment."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from nnscaler.graph.ir import Graph
from nnscaler.policies.autodist.cluster import ClusterSpec
from nnscaler.policies.autodist.comm import all_gather
from nnscaler.policies.autodist.constraints import PartitionConstraints
from nnscaler.policies.autodist.cost import CostContext
from nnscaler.policies.autodist.dataflow import crossing_values
from nnscaler.policies.autodist.memo import graph_memo
from nnscaler.policies.autodist.memory import MemoryModel
from nnscaler.policies.autodist.overlap import OverlapModel
from nnscaler.policies.autodist.saved_tensors import recompute_peak
from nnscaler.policies.autodist.transients import ZERO3_BLOCKS_LIVE, moe_rerun_bytes, zero3_block_bytes
from nnscaler.policies.expert_parallel import experts_nodes
from nnscaler.runtime.grads.buckets import DEFAULT_BUCKET_CAP_MB

__all__ = [
    "PlannerSetup",
    "mesh_for",
    "mesh_options",
    "stage_context",
    "transient_bytes",
    "fixed_costs",
    "local_weight_bytes",
    "segment_input",
]


@dataclass(frozen=True)
class PlannerSetup:
    """Everything the search needs besides the graph."""

    cluster: ClusterSpec
    plan_ngpus: int
    dp_size: int = 1
    memory: MemoryModel = field(default_factory=MemoryModel)
    mem_limit: float = math.inf
    """Bytes per device."""
    constraints: PartitionConstraints = field(default_factory=PartitionConstraints)
    recompute: tuple[str, ...] = ()
    """Module paths the user asked to recompute (pas_config recompute_modules)."""
    pivots: tuple[str, ...] | None = None
    training: bool = True
    compute_dtype: str | None = None
    traced_batch: int = 0
    solver: str = "auto"
    end2end: bool = False
    nstages: int | None = None
    """Pipeline stages: None searches (1 = no pipeline)."""
    nmicros: int | None = None
    """Micro-batches per step: None searches (1 without a pipeline)."""
    schedulers: tuple[str, ...] = ("1f1b",)
    """Pipeline schedules the search costs (schedule_choice.searched_schedules): the fastest that fits wins."""
    batch_scale: float = 1.0
    """Micro-batch size relative to the traced batch (recipes over fewer replicas take bigger batches)."""
    max_tp: int | None = None
    """Largest tensor-parallel degree to consider (offline planning: the devices of one node)."""
    global_batch: bool = False
    """Offline planning: the traced batch is the whole step's batch, shared by dp replicas x nmicros
    micro-batches (batch_scale = 1 / (dp x nmicros)); otherwise it is one micro-batch of one replica."""
    measured: dict[str, float] | None = None
    """Measured op times (pas_config['profile_db_path']), overriding the analytic ones where present."""
    tp_mesh: str | tuple[int, ...] = "auto"
    """Mesh splits: the mesh of a stage's tensor-parallel devices, 'auto' (searched), 'off' or a pinned
    (a, b) or (a, b, c) (see mesh_options)."""
    step_overhead: float = 0.0
    """Seconds one device spends per micro-batch outside its ops (the backward pass's start, the
    module's call), measured by the profiler; 0 without a measured database."""
    free_op: float = 0.0
    """Seconds of an op that moves no data (a view), measured by the profiler; 0 without a database."""
    bucket_bytes: float = DEFAULT_BUCKET_CAP_MB * 2**20
    """Gradient bucket size of the data-parallel sync (each bucket pays the collective's latency)."""
    cp_size: int | None = None
    """Context-parallel degree per stage: None searches it (autodist/context_parallel.py), 1 is off."""
    cp_kind: str | None = None
    """Context-parallel kind (plan.CP_KINDS): None searches it."""
    cp_ulysses_size: int | None = None
    """Ulysses group size of kind 'hybrid': None searches it."""
    cp_degree: int = 1
    """The cp degree this setup is the per-rank problem of (set by the cp search: batch_scale and
    dp_size already hold it; plan_ngpus is the devices left to tensor parallelism and pipelines)."""
    ep_size: int | None = 1
    """Expert-parallel degree per stage: None searches it (autodist/ep_search.py), 1 is off."""
    ep_degree: int = 1
    """The ep degree this setup is the per-rank problem of (set by the ep search, as cp_degree)."""
    overlap: OverlapModel = field(default_factory=OverlapModel)
    """How much of the data-parallel sync hides behind compute (autodist/overlap.py)."""


MAX_MESHES = 6
"""Most meshes the SPMD search solves for one stage under tp_mesh 'auto' (one ILP each)."""


def mesh_options(setup: PlannerSetup, ways: int, pipelined: bool = False) -> tuple[tuple[int, ...], ...]:
    """The meshes the SPMD search tries for a stage of `ways` devices (each is solved, the cheapest
    wins; every mesh's program also holds the 1-D choices). Under pas_config['tp_mesh'] 'auto': every
    factorisation a x b of `ways` with a, b > 1 (8: 2 x 4, 4 x 2), then, from 8 devices, 3-axis ones
    a x b x c (each > 1; those whose last axis fits in a node first) up to MAX_MESHES in all; none
    under pipeline stages (the pipeline search solves a stage program per configuration;
    docs/autodist.md). A pinned [a, b] or [a, b, c] where it has that many devices; none under 'off'.
    Choices (choices.py) put a batch-like identifier on axis 0 and other identifiers on the rest."""
    if setup.tp_mesh == "off":
        return ()
    if setup.tp_mesh == "auto":
        if pipelined:
            return ()
        two = tuple((a, ways // a) for a in range(2, ways // 2 + 1) if ways % a == 0)
        room = MAX_MESHES - len(two)
        if ways < 8 or room <= 0:
            return two
        per_node = setup.cluster.devices_per_node
        three = sorted((m for a, rest in two for m in _splits_of(rest, a)), key=lambda m: m[-1] > per_node)
        return two + tuple(three[:room])
    mesh = tuple(setup.tp_mesh)
    return (mesh,) if math.prod(mesh) == ways and len(mesh) in (2, 3) and min(mesh) > 1 else ()


def _splits_of(rest: int, a: int) -> list[tuple[int, int, int]]:
    """(a, b, c) for every b x c = rest with b, c > 1."""
    return [(a, b, rest // b) for b in range(2, rest // 2 + 1) if rest % b == 0]


def mesh_for(setup: PlannerSetup, ways: int, pipelined: bool = False) -> tuple[int, ...]:
    """The first mesh of mesh_options ((2, ways / 2) under 'auto'), or () (1-D splits only)."""
    options = mesh_options(setup, ways, pipelined)
    return options[0] if options else ()


def stage_context(setup: PlannerSetup, ways: int, pipelined: bool = False) -> CostContext:
    """The cost context of a stage of `ways` tensor-parallel devices (`pipelined`: one of several)."""
    return CostContext(
        setup.cluster,
        ways=ways,
        dp_size=setup.dp_size,
        dp_stride=setup.plan_ngpus,
        training=setup.training,
        compute_dtype=setup.compute_dtype,
        traced_batch=setup.traced_batch,
        batch_scale=setup.batch_scale,
        measured=setup.measured,
        free_op=setup.free_op,
        mesh=mesh_for(setup, ways, pipelined),
        mesh_options=mesh_options(setup, ways, pipelined),
        ep_degree=setup.ep_degree,
    )


def transient_bytes(
    graph: Graph, ctx: CostContext, setup: PlannerSetup, recompute: tuple[str, ...] | None = None
) -> float:
    """Bytes per device of transient buffers (communication, the largest op's workspace): a multiple of
    the largest value of the graph (MemoryModel.transient_mem_coef), the experts' stacked weights left
    out (a kernel or a ZeRO-3 gather holds one expert's at a time); once per graph and batch. Under
    recompute (`recompute`, else setup.recompute) at least what the largest recomputed module saves
    again while its backward runs (saved_tensors.recompute_peak), and an experts op's backward
    (transients.moe_rerun_bytes): the largest of these, measured on the zoo
    (benchmarks/memory_model_vs_measured.py); under ZeRO-3 the gathered blocks on top."""
    paths = setup.recompute if recompute is None else recompute
    rerun = recompute_peak(graph, tuple(paths), ctx) if paths and ctx.training else 0.0
    memo = graph_memo(graph).setdefault("largest_value", {})
    key = (ctx.batch_scale, ctx.traced_batch, ctx.compute_dtype)
    if key not in memo:
        experts = _expert_weights(graph)  # used one expert at a time
        memo[key] = max(
            (ctx.value_bytes(graph, v) for v in graph.values if graph.values[v].meta and v not in experts),
            default=0.0,
        )
    # one working set: the reruns happen in backward, after the loss's (largest) buffers are freed
    largest = setup.memory.transient_mem_coef * memo[key] / max(ctx.ways, 1)
    out = max(largest, rerun + moe_rerun_bytes(graph, ctx))  # an experts op's rerun inside a module's
    if setup.memory.zero_stage >= 3 and ctx.training and ctx.dp_size > 1:  # gathered blocks, full grads
        out += ZERO3_BLOCKS_LIVE * zero3_block_bytes(graph, ctx)
    return out


def _expert_weights(graph: Graph) -> frozenset[str]:
    """The weights the experts ops read (split over the ep degree under expert parallelism)."""
    memo = graph_memo(graph)
    if "expert_weights" not in memo:
        memo["expert_weights"] = frozenset(w for n in experts_nodes(graph) for w in n.input_names()[3:])
    return memo["expert_weights"]


def fixed_costs(graph: Graph, setup: PlannerSetup, ctx: CostContext, nmicros: int, stages: int = 1) -> float:
    """Seconds per step that do not belong to one op: the per-micro-batch overhead on the critical
    path ((nmicros + stages - 1) slots of a pipeline) and the runtime's check that the ranks of a plan
    got inputs of one shape (an all-gather of one int64 per forward call, or per train_step of a
    pipeline; runtime/dist/preflight.py). The gradient buckets' latency is the sync's
    (step_time.py: it overlaps compute with the rest of the sync)."""
    checks = nmicros if stages == 1 else 1
    check = all_gather(8.0 * setup.plan_ngpus, setup.plan_ngpus, setup.cluster.link(setup.plan_ngpus))
    return (nmicros + stages - 1) * setup.step_overhead + checks * check


def local_weight_bytes(graph: Graph, ctx: CostContext, stages: int = 1) -> float:
    """Bytes of weights one device holds on average: split over the stage's devices and the stages
    (the experts' 1/ep of them per rank under expert parallelism)."""
    experts = _expert_weights(graph)
    memo = graph_memo(graph).setdefault("weight_bytes", {})
    key = (ctx.compute_dtype, ctx.ep_degree)
    if key not in memo:
        memo[key] = sum(
            ctx.value_bytes(graph, name) / (ctx.ep_degree if name in experts else 1)
            for name, v in graph.values.items()
            if v.kind == "param"
        )
    return memo[key] / max(ctx.ways * stages, 1)


def segment_input(graph: Graph, ctx: CostContext, index: int) -> float:
    """Bytes per device of the activations entering the segment that starts at node `index` (all that
    cross the cut: the hidden state, skip connections, rotary tables, inputs read later)."""
    return sum(ctx.value_bytes(graph, r) for r in crossing_values(graph, index)) / ctx.ways
