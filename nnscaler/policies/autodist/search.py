"""The outer search: pipeline stages x tensor-parallel degree x micro-batches x recompute, each
scored for the whole step (stage times, bubble, gradient sync), the inner partition of every stage
from the SPMD search."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from nnscaler.config import ComputeConfig
from nnscaler.errors import PlanError
from nnscaler.graph.ir import Graph
from nnscaler.policies.autodist.candidate import Candidate
from nnscaler.policies.autodist.comm import send_recv
from nnscaler.policies.autodist.context import (
    PlannerSetup,
    segment_input,
    stage_context,
    transient_bytes,
)
from nnscaler.policies.autodist.cp_search import cp_search
from nnscaler.policies.autodist.ep_search import ep_search
from nnscaler.policies.autodist.evaluate import evaluate_nodes
from nnscaler.policies.autodist.layers import layer_instances
from nnscaler.policies.autodist.memo import graph_memo
from nnscaler.policies.autodist.pipeline_dp import native_available, stage_dp
from nnscaler.policies.autodist.schedule_choice import (
    ScheduleOption,
    pick_schedule,
    schedule_runs,
    stage_counts,
)
from nnscaler.policies.autodist.spmd import solve_spmd
from nnscaler.policies.autodist.spmd_problem import MEMORY_ADVICE
from nnscaler.policies.autodist.step_time import (
    RECOMPUTE_FACTOR,
    flat_memory,
    flat_step,
    pipelined_step,
    stage_memory,
)
from nnscaler.policies.op_cost import graph_costs
from nnscaler.policies.stage_balance import MAX_CANDIDATES, Segments, choose_stages
from nnscaler.policies.tp import pas_tp

__all__ = ["search", "divisors", "micro_options"]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def micro_options(setup: PlannerSetup, dp: int) -> list[int]:
    """Micro-batch counts to try when the global batch is fixed: powers of four leaving each micro-batch
    at least one sample of the traced batch."""
    if setup.nmicros:
        return [setup.nmicros]
    batch = max(setup.traced_batch, 1)
    return [m for m in (1, 4, 16, 64) if m * dp <= batch] or [1]


def _spmd_candidate(graph: Graph, setup: PlannerSetup, layer_paths: tuple[str, ...]) -> Candidate:
    ctx = stage_context(setup, setup.plan_ngpus)
    m = setup.nmicros or 1
    limit = setup.mem_limit - transient_bytes(graph, ctx, setup)
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
        step = flat_step(graph, setup, ctx, res.time, res.sync, m, bool(paths)).step
        memory = flat_memory(graph, setup, ctx, res, m)
        return Candidate(1, setup.plan_ngpus, m, rc, step, memory, res, recompute_paths=paths)
    raise error


def _segments(graph: Graph, instances: list[tuple[str, list[int]]]) -> list[int]:
    """First node index of every segment: the graph start, then each layer instance after the first."""
    return [0] + [idx[0] for _, idx in instances[1:]]


def _pipeline_candidates(
    graph: Graph,
    setup: PlannerSetup,
    instances,
    layer_paths: tuple[str, ...],
    refused: list[tuple[str, str]],
    user_pivots: tuple[str, ...] = (),
) -> list[Candidate]:
    """Every pipelined configuration that plans; `refused` gains (configuration, reason) for the others."""
    out: list[Candidate] = []
    seg_starts = _segments(graph, instances)
    for pp in divisors(setup.plan_ngpus):
        tp = setup.plan_ngpus // pp
        counts = {k: v for k, v in stage_counts(setup.schedulers, pp).items() if setup.nstages in (None, k)}
        if pp == 1 or not counts:
            continue
        if pp > len(seg_starts):
            refused.append(
                (f"pp={pp} tp={tp}", f"{pp} stages need {pp} layers, the model has {len(seg_starts)}")
            )
            continue
        if setup.max_tp is not None and tp > setup.max_tp:
            refused.append(
                (f"pp={pp} tp={tp}", f"tp={tp} is over max_tp={setup.max_tp} (one node's devices)")
            )
            continue
        ctx = stage_context(setup, tp, pipelined=True)
        limit = setup.mem_limit - transient_bytes(graph, ctx, setup)
        kept_inputs = sum(segment_input(graph, ctx, i) for i in seg_starts)  # stage 0's, all in flight
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
            except PlanError as exc:
                refused.append((f"pp={pp} tp={tp}{' +recompute' if rc else ''}", str(exc)))
                continue
            cannot_run: list[str] = []
            scored = _score_pipeline(
                graph,
                setup,
                res,
                ctx,
                pp,
                rc,
                limit,
                seg_starts,
                layer_paths,
                counts,
                user_pivots,
                cannot_run,
            )
            if not scored and cannot_run:  # every schedule refused the shape: say why, not memory
                refused.append((f"pp={pp} tp={tp}{' +recompute' if rc else ''}", "; ".join(cannot_run)))
            elif not scored:
                refused.append(
                    (
                        f"pp={pp} tp={tp}{' +recompute' if rc else ''}",
                        f"no stage boundaries keep every stage within {limit / 1e9:.2f} GB per device "
                        "(1F1B keeps up to pp micro-batches of activations on stage 0): raise "
                        "pas_config['mem_constraint'] or recompute",
                    )
                )
            out.extend(scored)
    return out


def _score_pipeline(
    graph, setup, res, ctx, pp, rc, limit, layer_starts, layer_paths, counts, user_pivots=(), cannot_run=None
) -> list[Candidate]:
    """Stage boundaries, schedule and whole-step time of one (pp, tp, recompute) for each micro-batch
    count: `counts` maps stage counts to the schedules that run them (schedule_choice.py).
    The boundaries come from the balancer the pp/hybrid policies use (stage_balance.choose_stages:
    blocks first, finer places where blocks are too unequal), costed by this plan's node times."""
    tp = ctx.ways
    own_rc = rc and not setup.recompute
    factor = RECOMPUTE_FACTOR if (own_rc or setup.recompute) else 1.0
    names = [n.name for n in graph.nodes]
    time = [res.node_time[n] * factor for n in names]
    act = [res.choice[n].activation_bytes for n in names]
    param = [res.node_memory[n] - res.choice[n].activation_bytes for n in names]
    if own_rc:  # recomputed layers keep only their inputs
        act = [0.0] * len(names)
        for i in layer_starts:
            act[i] += segment_input(graph, ctx, i)
    link = setup.cluster.link(2, tp)
    crossing = graph_costs(graph).cross_bytes
    scale = ctx.batch_scale / max(tp, 1)

    def segments_for(cands: list[int]) -> Segments:
        bounds = list(cands) + [len(names)]
        span = list(zip(bounds, bounds[1:]))
        return Segments(
            list(cands),
            [sum(time[a:b]) for a, b in span],
            [sum(act[a:b]) for a, b in span],
            [sum(param[a:b]) for a, b in span],
            [2 * send_recv(crossing[a] * scale, 2, link) if a else 0.0 for a, _ in span],
        )

    whole = tuple(layer_paths if own_rc else setup.recompute or ())  # each checkpointed in one stage
    most = 8 * MAX_CANDIDATES if native_available() else MAX_CANDIDATES  # the C++ loop is ~50x faster
    inputs = _StageInputs(graph, setup, ctx, res, names, time, act, param, segments_for, whole, most, limit)
    out = []
    for m in [setup.nmicros] if setup.nmicros else [pp, 2 * pp, 4 * pp]:
        cuts, options = {}, []
        for nstages, schedules in counts.items():
            cut = _cut(inputs, user_pivots, nstages, m)
            if isinstance(cut, str):
                options += [ScheduleOption(s, 0.0, 0.0, 0.0, nstages, False, cut) for s in schedules]
                continue
            cuts[nstages] = cut
            rc_any = own_rc or bool(setup.recompute)
            options += [_cost_schedule(graph, setup, ctx, cut, s, pp, m, rc_any, limit) for s in schedules]
        best, costed = pick_schedule(options)
        if best is None:
            if cannot_run is not None and all(o.why_not.startswith("cannot run") for o in costed):
                cannot_run.extend(f"{o.scheduler} with {m} micro-batches {o.why_not}" for o in costed)
            continue
        cut = cuts[best.nstages]
        paths = layer_paths if own_rc else setup.recompute
        cand = Candidate(pp, tp, m, rc, best.step, best.memory, res, cut.starts, cut.times, paths)
        cand.scheduler, cand.bubble_share, cand.schedule_options = best.scheduler, best.bubble_share, costed
        out.append(cand)
    return out


@dataclass(frozen=True)
class _StageInputs:
    """What cutting one configuration's nodes into stages reads (per node: time, activations, state)."""

    graph: Graph
    setup: PlannerSetup
    ctx: object
    res: object
    names: list[str]
    time: list[float]
    act: list[float]
    param: list[float]
    segments_for: object
    whole: tuple[str, ...]
    most: int
    limit: float


def _cut(inputs: _StageInputs, user_pivots: tuple[str, ...], nstages: int, m: int) -> _StageCut | str:
    """The balanced cut into `nstages` stages with what each costs, or why there is none."""
    try:
        choice = choose_stages(
            inputs.graph,
            nstages,
            inputs.segments_for,
            user_pivots,
            whole=inputs.whole,
            nmicros=m,
            mem_limit=inputs.limit,
            dp=stage_dp,
            max_candidates=inputs.most,
        )
    except PlanError as exc:
        return str(exc)
    if choice is None:
        return f"no {nstages}-stage cut keeps every stage within {inputs.limit / 1e9:.2f} GB per device"
    names = inputs.names
    sb = choice.starts + [len(names)]
    spans = [(sb[s], sb[s + 1]) for s in range(nstages)]
    return _StageCut(
        choice.starts,
        [sum(inputs.time[a:b]) for a, b in spans],
        [sum(inputs.res.node_sync[n] for n in names[a:b]) for a, b in spans],
        [sum(inputs.param[a:b]) for a, b in spans],
        [sum(inputs.act[a:b]) for a, b in spans],
    )


@dataclass(frozen=True)
class _StageCut:
    """One cut of the layers into stages, with what each stage costs."""

    starts: list[int]
    times: list[float]
    syncs: list[float]
    params: list[float]
    acts: list[float]


def _cost_schedule(graph, setup, ctx, stage: _StageCut, scheduler, pp, m, recompute, limit) -> ScheduleOption:
    """One schedule on one stage cut: its step, memory and bubble, or why it cannot run."""
    nstages = len(stage.starts)
    why = schedule_runs(scheduler, nstages, pp, m)
    if why:
        return ScheduleOption(scheduler, 0.0, 0.0, 0.0, nstages, False, f"cannot run: {why}")
    step = pipelined_step(
        graph, setup, ctx, stage.times, stage.syncs, stage.starts, pp, m, recompute, scheduler
    )
    mem = max(stage_memory(stage.params, stage.acts, scheduler, pp, m))
    share = step.pipeline.bubble / step.step if step.step > 0 else 0.0
    if mem > limit:
        why = f"needs {mem / 1e9:.2f} GB on its fullest device, over the limit of {limit / 1e9:.2f} GB"
        return ScheduleOption(scheduler, step.step, mem, share, nstages, False, why)
    return ScheduleOption(scheduler, step.step, mem, share, nstages, True)


def _megatron_alternatives(graph: Graph, setup: PlannerSetup, scored: list[Candidate]) -> list[Candidate]:
    """The tp policy's layout in the best configuration of each (pp, tp): kept if it fits."""
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
                scheduler=c.scheduler,
            )
        except PlanError:
            continue
        if alt.memory <= setup.mem_limit:
            alt.origin, alt.schedule_options = "megatron", c.schedule_options
            out.append(alt)
    return out


def _check_stage_count(setup: PlannerSetup) -> None:
    """A fixed pipeline_nstages the devices or the compute config cannot give: PlanError saying which."""
    k, n = setup.nstages, setup.plan_ngpus
    if not any(k in stage_counts(setup.schedulers, pp) for pp in divisors(n) if pp > 1) and (k > n or n % k):
        raise PlanError(
            f"autodist: pas_config['pipeline_nstages']={k} cannot split plan_ngpus={n} devices into stages "
            f"of equal size (each stage runs on plan_ngpus / pipeline_nstages devices): use one of "
            f"{divisors(n)}, or plan for a multiple of {k} devices"
        )
    if not setup.end2end or not setup.training:
        need = "ComputeConfig(use_end2end=True)" if not setup.end2end else "training (inference_only=False)"
        raise PlanError(
            f"autodist: pas_config['pipeline_nstages']={k} needs {need}: autodist plans pipelines only for "
            "end-to-end training steps; drop pipeline_nstages or set it"
        )


def _on_pinned_mesh(setup: PlannerSetup, scored: list[Candidate], refused: list) -> list[Candidate]:
    """Under a pinned pas_config['tp_mesh'], only configurations whose stages have the mesh's device
    count (elsewhere the mesh would be dropped without a word; issue 41)."""
    if not isinstance(setup.tp_mesh, tuple):
        return scored
    size = math.prod(setup.tp_mesh)
    for c in scored:
        if c.tp != size:
            refused.append(
                (c.label(), f"pas_config['tp_mesh']={list(setup.tp_mesh)} needs stages of {size} devices")
            )
    return [c for c in scored if c.tp == size]


def _nothing_planned(ndevices: int, refused: list[tuple[str, str]]) -> PlanError:
    """The error when every configuration was refused: each reason once, with the configurations it
    refused (the advice after a memory reason once, at the end)."""
    if not refused:
        return PlanError(f"autodist: no configuration of {ndevices} devices could be tried")
    if len(refused) == 1:
        why = refused[0][1]
        return PlanError(why if why.startswith("autodist") else f"autodist: {why}")
    reasons: dict[str, list[str]] = {}
    advice = ""
    for config, why in refused:
        why, mark, rest = why.removeprefix("autodist: ").partition(MEMORY_ADVICE)
        advice = advice or (mark + rest).removeprefix(": ")
        reasons.setdefault(why, []).append(config)
    lines = [f"  - {'; '.join(configs)}: {why}" for why, configs in reasons.items()]
    tail = f"\nfor memory: {advice}" if advice else ""
    return PlanError(
        f"autodist: no configuration of {ndevices} devices could be planned:\n" + "\n".join(lines) + tail
    )


def search(graph: Graph, setup: PlannerSetup) -> tuple[Candidate, list[Candidate]]:
    """The best configuration (by time per micro-batch) and every configuration scored, expert-parallel
    degrees (ep_search.py) and context-parallel degrees and kinds (cp_search.py) included: each degree's
    remaining devices searched as below."""
    return ep_search(graph, setup, _search_cp)


def _search_cp(graph: Graph, setup: PlannerSetup) -> tuple[Candidate, list[Candidate]]:
    """The search of one expert-parallel per-rank problem: cp degrees and kinds (cp_search.py)."""
    return cp_search(graph, setup, _search_devices)


def _search_devices(graph: Graph, setup: PlannerSetup) -> tuple[Candidate, list[Candidate]]:
    """The best configuration of the plan devices without context parallelism, and every one scored."""
    user_pivots = tuple(setup.pivots or ())
    pivots, instances = layer_instances(graph, setup.pivots)
    layer_paths = tuple(p for p, _ in instances)
    setup = replace(setup, pivots=pivots or setup.pivots)
    scored: list[Candidate] = []
    refused: list[tuple[str, str]] = []  # (configuration, why it was not planned)
    n = setup.plan_ngpus
    if setup.nstages in (None, 1):
        if setup.max_tp is not None and n > setup.max_tp:
            refused.append((f"pp=1 tp={n}", f"tp={n} is over max_tp={setup.max_tp} (one node's devices)"))
        else:
            try:
                scored.append(_spmd_candidate(graph, setup, layer_paths))
            except PlanError as exc:
                refused.append((f"pp=1 tp={n}", str(exc)))
    else:
        _check_stage_count(setup)
    if setup.nstages not in (None, 1) and len(instances) < setup.nstages:
        raise PlanError(
            f"autodist: pipeline_nstages={setup.nstages} needs at least {setup.nstages} layers to start "
            f"stages at, but the model has {len(instances)} instance(s) of pivot class(es) "
            f"{list(pivots) or 'none found'}; set pas_config['pipeline_pivots'] to the class name of "
            "modules that follow one another in forward (e.g. 'LlamaDecoderLayer', or 'Linear' for a "
            "plain stack of linears), or drop pipeline_nstages"
        )
    if setup.end2end and setup.training and setup.nstages != 1 and len(instances) > 1:
        scored.extend(_pipeline_candidates(graph, setup, instances, layer_paths, refused, user_pivots))
    if not scored:
        raise _nothing_planned(n, refused)
    if setup.constraints.rules == () and setup.plan_ngpus > 1:
        scored.extend(_megatron_alternatives(graph, setup, scored))
    scored = _on_pinned_mesh(setup, scored, refused)
    if not scored:
        raise _nothing_planned(n, refused)
    for c in scored:
        c.zero = setup.memory.zero_stage if setup.dp_size > 1 else 0
    best = min(scored, key=lambda c: (c.time_per_micro, c.pp, -c.tp, c.recompute))
    return best, scored
