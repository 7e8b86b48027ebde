"""The outer search: pipeline stages x tensor-parallel degree x micro-batches x recompute, each
scored for the whole step (stage times, bubble, gradient sync), the inner partition of every stage
from the SPMD search."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from nnscaler.errors import PlanError
from nnscaler.graph.ir import Graph
from nnscaler.policies.autodist.cluster import ClusterSpec
from nnscaler.policies.autodist.comm import all_gather, send_recv
from nnscaler.policies.autodist.constraints import PartitionConstraints
from nnscaler.policies.autodist.cost import CostContext
from nnscaler.policies.autodist.dataflow import crossing_values
from nnscaler.policies.autodist.layers import layer_instances
from nnscaler.policies.autodist.memo import graph_memo
from nnscaler.policies.autodist.memory import MemoryModel
from nnscaler.policies.autodist.pipeline_dp import stage_dp
from nnscaler.policies.autodist.spmd import SpmdResult, solve_spmd
from nnscaler.runtime.grads.buckets import DEFAULT_BUCKET_CAP_MB

__all__ = ["PlannerSetup", "Candidate", "search", "divisors", "fixed_costs"]


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
    batch_scale: float = 1.0
    """Micro-batch size relative to the traced batch (recipes over fewer replicas take bigger batches)."""
    max_tp: int | None = None
    """Largest tensor-parallel degree to consider (offline planning: the devices of one node)."""
    global_batch: bool = False
    """Offline planning: the traced batch is the whole step's batch, shared by dp replicas x nmicros
    micro-batches (batch_scale = 1 / (dp x nmicros)); otherwise it is one micro-batch of one replica."""
    measured: dict[str, float] | None = None
    tp_mesh: str | tuple[int, ...] = "auto"
    """2-D splits: the mesh of a stage's tensor-parallel devices, 'auto' or 'off' (see mesh_for)."""
    """Measured op times (pas_config['profile_db_path']), overriding the analytic ones where present."""
    step_overhead: float = 0.0
    """Seconds one device spends per micro-batch outside its ops (the backward pass's start, the
    module's call), measured by the profiler; 0 without a measured database."""
    free_op: float = 0.0
    """Seconds of an op that moves no data (a view), measured by the profiler; 0 without a database."""
    bucket_bytes: float = DEFAULT_BUCKET_CAP_MB * 2**20
    """Gradient bucket size of the data-parallel sync (each bucket pays the collective's latency)."""


@dataclass
class Candidate:
    """One scored configuration of the plan devices."""

    pp: int
    tp: int
    nmicros: int
    recompute: bool
    step_time: float
    """Seconds per step of `nmicros` micro-batches."""
    memory: float
    """Bytes on the fullest device."""
    spmd: SpmdResult
    starts: list[int] = field(default_factory=list)
    """Node index where each pipeline stage starts (pp > 1)."""
    stage_times: list[float] = field(default_factory=list)
    recompute_paths: tuple[str, ...] = ()
    zero: int = 0
    """ZeRO stage the candidate was costed with (shown in its label when not 0)."""
    origin: str = "ilp"
    """'ilp': the searched partition; 'megatron': the tp policy's layout, kept where the model scores it
    better (the ILP works on folded layers and per-edge costs, so a hand-made layout can edge it out)."""

    @property
    def time_per_micro(self) -> float:
        return self.step_time / self.nmicros

    def label(self) -> str:
        rc = ", recompute" if self.recompute else ""
        seed = ", megatron layout" if self.origin == "megatron" else ""
        zero = f", zero{self.zero}" if self.zero else ""
        return f"pp={self.pp} tp={self.tp} nmicros={self.nmicros}{rc}{seed}{zero}"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def micro_options(setup: PlannerSetup, dp: int) -> list[int]:
    """Micro-batch counts to try when the global batch is fixed: powers of four leaving each micro-batch
    at least one sample of the traced batch."""
    if setup.nmicros:
        return [setup.nmicros]
    batch = max(setup.traced_batch, 1)
    return [m for m in (1, 4, 16, 64) if m * dp <= batch] or [1]


def mesh_for(setup: PlannerSetup, ways: int, pipelined: bool = False) -> tuple[int, ...]:
    """The 2-D mesh offered to a stage of `ways` devices: pas_config['tp_mesh'] where it has that many
    devices; under 'auto', [2, ways / 2] for an even degree of 4 or more without pipeline stages (the
    pipeline search solves a stage program per configuration: 2-D choices there tripled the 70B
    search time); else () (1-D splits only)."""
    if setup.tp_mesh == "off":
        return ()
    if setup.tp_mesh == "auto":
        return (2, ways // 2) if ways >= 4 and ways % 2 == 0 and not pipelined else ()
    mesh = tuple(setup.tp_mesh)
    return mesh if math.prod(mesh) == ways and len(mesh) == 2 and min(mesh) > 1 else ()


def _ctx(setup: PlannerSetup, ways: int, pipelined: bool = False) -> CostContext:
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
    )


def _transient(graph: Graph, ctx: CostContext, setup: PlannerSetup) -> float:
    memo = graph_memo(graph).setdefault("largest_value", {})
    key = (ctx.batch_scale, ctx.traced_batch, ctx.compute_dtype)
    if key not in memo:
        memo[key] = max(
            (ctx.value_bytes(graph, v) for v in graph.values if graph.values[v].meta), default=0.0
        )
    return setup.memory.transient_mem_coef * memo[key] / max(ctx.ways, 1)


def fixed_costs(graph: Graph, setup: PlannerSetup, ctx: CostContext, nmicros: int, stages: int = 1) -> float:
    """Seconds per step that do not belong to one op: the per-micro-batch overhead on the critical
    path ((nmicros + stages - 1) slots of a pipeline), the latency of the gradient buckets, and the
    runtime's check that the ranks of a plan got inputs of one shape (an all-gather of one int64 per
    forward call, or per train_step of a pipeline; runtime/preflight.py)."""
    weight_bytes = sum(
        ctx.value_bytes(graph, name) for name, v in graph.values.items() if v.kind == "param"
    ) / max(ctx.ways * stages, 1)
    latency = setup.memory.grad_sync_latency(weight_bytes, ctx, setup.bucket_bytes)
    checks = nmicros if stages == 1 else 1
    check = all_gather(8.0 * setup.plan_ngpus, setup.plan_ngpus, setup.cluster.link(setup.plan_ngpus))
    return (nmicros + stages - 1) * setup.step_overhead + latency + checks * check


def _spmd_candidate(graph: Graph, setup: PlannerSetup, layer_paths: tuple[str, ...]) -> Candidate:
    ctx = _ctx(setup, setup.plan_ngpus)
    m = setup.nmicros or 1
    limit = setup.mem_limit - _transient(graph, ctx, setup)
    tries = [(False, setup.recompute)]
    if not setup.recompute and layer_paths and setup.training:
        tries.append((True, layer_paths))
    error: PlanError | None = None
    for rc, paths in tries:
        try:
            res = solve_spmd(
                graph,
                ctx,
                setup.memory,
                constraints=setup.constraints,
                mem_limit=None if math.isinf(limit) else limit,
                recompute=paths,
                pivots=setup.pivots,
                solver=setup.solver,
                nmicros=m,
            )
        except PlanError as exc:
            error = exc
            continue
        factor = 4.0 / 3.0 if paths else 1.0  # recomputed modules run their forward twice
        step = res.time * m * factor + res.sync + fixed_costs(graph, setup, ctx, m)
        return Candidate(1, setup.plan_ngpus, m, rc, step, res.memory, res, recompute_paths=paths)
    raise error


def _segments(graph: Graph, instances: list[tuple[str, list[int]]]) -> list[int]:
    """First node index of every segment: the graph start, then each layer instance after the first."""
    return [0] + [idx[0] for _, idx in instances[1:]]


def _pipeline_candidates(
    graph: Graph, setup: PlannerSetup, instances, layer_paths: tuple[str, ...]
) -> list[Candidate]:
    out: list[Candidate] = []
    seg_starts = _segments(graph, instances)
    for pp in divisors(setup.plan_ngpus):
        tp = setup.plan_ngpus // pp
        if pp == 1 or pp > len(seg_starts) or (setup.nstages is not None and setup.nstages != pp):
            continue
        if setup.max_tp is not None and tp > setup.max_tp:
            continue
        ctx = _ctx(setup, tp, pipelined=True)
        limit = setup.mem_limit - _transient(graph, ctx, setup)
        kept_inputs = sum(_segment_input(graph, ctx, i) for i in seg_starts)  # stage 0's, all in flight
        for rc in [bool(setup.recompute)] if setup.recompute else [False, True]:
            own_rc = rc and not setup.recompute
            ilp_limit = limit - (kept_inputs if own_rc else 0.0)
            # a stage keeps ~1/pp of the weights and (stage 0, 1F1B) ~one micro-batch of all activations
            try:
                res = solve_spmd(
                    graph,
                    ctx,
                    setup.memory,
                    constraints=setup.constraints,
                    recompute=setup.recompute,
                    pivots=setup.pivots,
                    solver=setup.solver,
                    mem_limit=None if math.isinf(limit) else ilp_limit,
                    mem_weights=(1.0 / pp, 0.0 if own_rc else 1.0),
                )
            except PlanError:
                continue
            out.extend(_score_pipeline(graph, setup, res, ctx, pp, rc, limit, seg_starts, layer_paths))
    return out


def _segment_input(graph: Graph, ctx: CostContext, index: int) -> float:
    """Bytes per device of the activations entering the segment that starts at node `index` (all that
    cross the cut: the hidden state, skip connections, rotary tables, inputs read later)."""
    return sum(ctx.value_bytes(graph, r) for r in crossing_values(graph, index)) / ctx.ways


def _score_pipeline(graph, setup, res, ctx, pp, rc, limit, seg_starts, layer_paths) -> list[Candidate]:
    """Stage boundaries and the whole-step time of one (pp, tp, recompute) for each micro-batch count."""
    tp, nseg = ctx.ways, len(seg_starts)
    bounds = seg_starts + [len(graph.nodes)]
    seg_time, seg_act, seg_param, seg_sync, seg_in = [], [], [], [], []
    for k in range(nseg):
        names = [graph.nodes[i].name for i in range(bounds[k], bounds[k + 1])]
        seg_time.append(sum(res.node_time[n] for n in names))
        seg_act.append(sum(res.choice[n].activation_bytes for n in names))
        seg_param.append(sum(res.node_memory[n] - res.choice[n].activation_bytes for n in names))
        seg_sync.append(sum(res.node_sync[n] for n in names))
        seg_in.append(_segment_input(graph, ctx, bounds[k]))
    own_rc = rc and not setup.recompute
    times = [t * 4.0 / 3.0 for t in seg_time] if (own_rc or setup.recompute) else seg_time
    acts = seg_in if own_rc else seg_act
    out = []
    for m in [setup.nmicros] if setup.nmicros else [pp, 2 * pp, 4 * pp]:
        t_max, starts = stage_dp(times, acts, seg_param, pp, m, limit)
        if math.isinf(t_max):
            continue
        sb = starts + [nseg]
        stage_times = [sum(times[sb[s] : sb[s + 1]]) for s in range(pp)]
        sync = max(sum(seg_sync[sb[s] : sb[s + 1]]) for s in range(pp))
        hop = max(seg_in)  # one boundary activation, this device's share
        p2p = 2 * (pp - 1) * send_recv(hop, 2, setup.cluster.link(2, tp))
        step = (m + pp - 1) * t_max + p2p + sync + fixed_costs(graph, setup, ctx, m, pp)
        mem = max(
            sum(seg_param[sb[s] : sb[s + 1]]) + sum(acts[sb[s] : sb[s + 1]]) * min(pp - s, m)
            for s in range(pp)
        )
        starts_at = [seg_starts[i] for i in starts]
        paths = layer_paths if own_rc else setup.recompute
        out.append(Candidate(pp, tp, m, rc, step, mem, res, starts_at, stage_times, paths))
    return out


def _megatron_alternatives(graph: Graph, setup: PlannerSetup, scored: list[Candidate]) -> list[Candidate]:
    """The tp policy's layout in the best configuration of each (pp, tp): kept if it fits."""
    from nnscaler.config import ComputeConfig
    from nnscaler.policies.autodist.evaluate import evaluate_nodes
    from nnscaler.policies.tp import pas_tp

    best: dict[tuple[int, int], Candidate] = {}
    for c in scored:
        key = (c.pp, c.tp)
        if c.tp > 1 and (key not in best or c.time_per_micro < best[key].time_per_micro):
            best[key] = c
    out = []
    tp_nodes = graph_memo(graph).setdefault("tp_policy_nodes", {})  # the tp policy's splits per degree
    for (pp, tp), c in sorted(best.items()):
        try:
            if tp not in tp_nodes:
                tp_nodes[tp] = pas_tp(graph, ComputeConfig(tp, tp)).nodes
            nodes = tp_nodes[tp]
            alt = evaluate_nodes(
                graph,
                setup,
                nodes,
                pp=pp,
                starts=c.starts or None,
                nmicros=c.nmicros,
                recompute=c.recompute_paths,
            )
        except PlanError:
            continue
        if alt.memory <= setup.mem_limit:
            alt.origin = "megatron"
            out.append(alt)
    return out


def search(graph: Graph, setup: PlannerSetup) -> tuple[Candidate, list[Candidate]]:
    """The best configuration (by time per micro-batch) and every configuration scored."""
    pivots, instances = layer_instances(graph, setup.pivots)
    layer_paths = tuple(p for p, _ in instances)
    setup = replace(setup, pivots=pivots or setup.pivots)
    scored: list[Candidate] = []
    errors: list[str] = []
    spmd_ok = setup.max_tp is None or setup.plan_ngpus <= setup.max_tp
    if setup.nstages in (None, 1) and spmd_ok:
        try:
            scored.append(_spmd_candidate(graph, setup, layer_paths))
        except PlanError as exc:
            errors.append(str(exc))
    if setup.nstages not in (None, 1) and len(instances) < setup.nstages:
        raise PlanError(
            f"autodist: pipeline_nstages={setup.nstages} needs at least {setup.nstages} layers to start "
            f"stages at, but the model has {len(instances)} instance(s) of pivot class(es) "
            f"{list(pivots) or 'none found'}; set pas_config['pipeline_pivots'] to the class name of "
            "modules that follow one another in forward (e.g. 'LlamaDecoderLayer', or 'Linear' for a "
            "plain stack of linears), or drop pipeline_nstages"
        )
    if setup.end2end and setup.training and setup.nstages != 1 and len(instances) > 1:
        scored.extend(_pipeline_candidates(graph, setup, instances, layer_paths))
    if not scored:
        why = errors[0] if errors else "no configuration fits the memory limit"
        raise PlanError(f"autodist: {why}")
    if setup.constraints.rules == () and setup.plan_ngpus > 1:
        scored.extend(_megatron_alternatives(graph, setup, scored))
    for c in scored:
        c.zero = setup.memory.zero_stage if setup.dp_size > 1 else 0
    best = min(scored, key=lambda c: (c.time_per_micro, c.pp, -c.tp, c.recompute))
    return best, scored
