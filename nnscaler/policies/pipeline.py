"""The `pp` and `hybrid` policies: pipeline stages (x tensor parallelism inside each stage).

pas_config keys (typed in nnscaler.policies.options, PpOptions / HybridOptions): `pipeline_nstages`
(int or 'auto'), `pipeline_nmicros` (required), `pipeline_scheduler` ('1f1b' default, 'gpipe',
'1f1b_interleaved', and the zero-bubble 'zb_h1', 'zbv', 'dualpipev'; zbv and dualpipev run two
stages per device group in a V), `pipeline_pivots` (module class names where stages may start; default: the
model's blocks, finer where they are too unequal to balance: stage_balance.py),
`pipeline_stages` (module paths where stages 1.. start, instead of balancing),
and for `hybrid` `pp_size` (device groups; default `pipeline_nstages`, tensor parallelism inside each
group over plan_ngpus // pp_size devices).
"""

from __future__ import annotations

import logging
import warnings

from nnscaler.config import ComputeConfig
from nnscaler.errors import PlanError
from nnscaler.graph.ir import Graph, cut_graph
from nnscaler.policies.context_parallel import context_parallel_of, with_context_parallel
from nnscaler.policies.expert_parallel import check_ep_size, with_expert_parallel
from nnscaler.policies.nccl_sim import check_nccl
from nnscaler.policies.op_cost import graph_costs
from nnscaler.policies.options import HybridOptions, PipelineOptions, PpOptions
from nnscaler.policies.pipeline_actions import V_SHAPED
from nnscaler.policies.plan import SCHEDULERS, NodePlan, PipelinePlan, Plan
from nnscaler.policies.recompute import recompute_paths
from nnscaler.policies.schedules import simulate
from nnscaler.policies.stage_balance import balanced_stages, stage_summary
from nnscaler.policies.staging import default_pivots, explicit_starts, parse_pivots
from nnscaler.policies.tp import pas_tp

__all__ = ["pas_pp", "pas_hybrid", "check_end2end_loss", "validate_pipeline"]

_log = logging.getLogger(__name__)


def check_end2end_loss(graph: Graph) -> None:
    """End-to-end mode: the forward's first output must be a scalar floating-point loss."""
    outs = graph.output_names()
    first = graph.outputs[0] if graph.outputs else None
    meta = graph.values[outs[0]].meta if outs and getattr(first, "name", None) == outs[0] else None
    if meta is None or meta.shape != () or not meta.is_float:
        got = "no tensor" if meta is None else f"a {meta.dtype} tensor of shape {list(meta.shape)}"
        raise PlanError(
            "ComputeConfig(use_end2end=True) needs the forward to return the loss as its first output, a scalar "
            f"float tensor; the traced forward's first output is {got} (reduce the loss to a scalar, e.g. .mean())"
        )


def _repeated_layers(graph: Graph, opts: PipelineOptions) -> tuple[str, ...] | None:
    """The class of the repeated layers (for people reading the plan); None when the model has none
    and nothing else says where stages start (then nnScaler 0.8 splits the operators evenly)."""
    try:
        return default_pivots(graph)
    except PlanError:
        return () if opts.pipeline_stages else None


def _even_or_balanced(graph: Graph, nstages: int, whole: tuple[str, ...]) -> tuple[list[int], str]:
    """nnScaler 0.8's rule for a model without repeated layers (the operators split evenly, with a
    warning), unless that leaves a stage without weights where the balancer gives every stage some."""
    starts = _even_starts(len(graph.nodes), nstages)
    bare = [k for k, p in enumerate(graph_costs(graph).params_of(graph, starts)) if p == 0]
    if bare:
        choice = balanced_stages(graph, nstages, (), whole)
        if all(p > 0 for p in graph_costs(graph).params_of(graph, choice.starts)):
            warnings.warn(
                f"pipeline: no pipeline_pivots given and no repeated layers found; splitting the {len(graph.nodes)} "
                f"operators evenly (nnScaler 0.8's rule) would leave stage(s) {bare} without weights, so the "
                "stages are balanced by cost instead; set pas_config['pipeline_pivots'] to choose",
                stacklevel=3,
            )
            return choice.starts, f"balanced at {choice.level}"
    warnings.warn(
        "pipeline: no pipeline_pivots given and no repeated layers found, so the stages split the "
        f"{len(graph.nodes)} operators evenly (nnScaler 0.8's rule); set pas_config['pipeline_pivots'] "
        "to start stages at module boundaries",
        stacklevel=3,
    )
    return starts, "splitting the operators evenly"


def _even_starts(nnodes: int, nstages: int) -> list[int]:
    """Stage starts splitting `nnodes` operators into `nstages` runs whose sizes differ by at most one
    (the first runs the longer ones)."""
    if nstages > nnodes:
        raise PlanError(f"pipeline_nstages={nstages} but the model has only {nnodes} operators")
    size, extra = divmod(nnodes, nstages)
    return [i * size + min(i, extra) for i in range(nstages)]


def _nstages(opts: PipelineOptions) -> int | None:
    return None if opts.pipeline_nstages == "auto" else opts.pipeline_nstages


def _pipeline(
    graph: Graph, cfg: ComputeConfig, opts: PipelineOptions, pp_size: int, nstages: int
) -> PipelinePlan:
    if not cfg.use_end2end:
        raise PlanError(
            "pipeline parallelism needs ComputeConfig(use_end2end=True): the runtime drives forward and backward "
            "of the micro-batches itself (model.train_step(samples))"
        )
    check_end2end_loss(graph)
    scheduler = opts.pipeline_scheduler
    if scheduler not in SCHEDULERS:
        raise PlanError(f"pas_config['pipeline_scheduler']={scheduler!r}: use one of {list(SCHEDULERS)}")
    nmicros = opts.pipeline_nmicros
    if nmicros is None:
        raise PlanError(
            "pipelines need pas_config['pipeline_nmicros']: the number of micro-batches per train_step"
        )
    pivots = parse_pivots(opts.pipeline_pivots)
    explicit = opts.pipeline_stages
    layers = () if pivots else _repeated_layers(graph, opts)
    whole = recompute_paths(graph, opts.recompute_modules)  # each checkpointed in one stage
    if layers is None:  # nnScaler's rule: the operators split evenly over the stages
        starts, how = _even_or_balanced(graph, nstages, whole)
    elif explicit:
        starts = explicit_starts(graph, list(explicit))
        if len(starts) != nstages:
            raise PlanError(
                f"pas_config['pipeline_stages'] names {len(starts) - 1} stage starts, so {len(starts)} stages, "
                f"but pipeline_nstages is {nstages}"
            )
        how = "as pipeline_stages names them"
    else:
        choice = balanced_stages(graph, nstages, pivots, whole)
        starts, how = choice.starts, f"balanced at {choice.level}"
    summary = f"pipeline {stage_summary(graph, starts)} ({how})"
    _log.info("%s", summary)
    plan = PipelinePlan(
        tuple(graph.nodes[i].name for i in starts),
        pp_size,
        nmicros,
        scheduler,
        pivots or layers or (),
    )
    simulate(scheduler, nstages, pp_size, nmicros)  # raises on schedules that cannot run
    check_nccl(scheduler, nstages, pp_size, nmicros)  # and on P2P orders that would hang on NCCL
    return plan


def _shares_note(graph: Graph, pipeline: PipelinePlan) -> str:
    """'pipeline stages: FLOPs 26%/25%/..., weights ...' for the plan's notes (plan.json)."""
    first = set(pipeline.starts)
    return f"pipeline {stage_summary(graph, [i for i, n in enumerate(graph.nodes) if n.name in first])}"


def pas_pp(graph: Graph, cfg: ComputeConfig) -> Plan:
    """One pipeline stage per plan device (virtual stages with '1f1b_interleaved'), no tensor parallelism."""
    # typed pas_config; unknown keys are refused by parallelize / compile_module (not here: a custom
    # policy calling pas_pp may carry keys of its own)
    opts = PpOptions.from_pas_config(cfg.pas_config, strict=False)
    pp_size = cfg.plan_ngpus
    interleaved = opts.pipeline_scheduler in ("1f1b_interleaved", *V_SHAPED)
    nstages = _nstages(opts) or pp_size * (2 if interleaved else 1)
    if nstages % pp_size:
        raise PlanError(
            f"policy 'pp' runs one stage per plan device: pipeline_nstages ({nstages}) must be a multiple of "
            f"plan_ngpus ({pp_size})"
        )
    pipeline = _pipeline(graph, cfg, opts, pp_size, nstages)
    nodes = {n.name: NodePlan() for n in graph.nodes}
    return Plan("pp", cfg.plan_ngpus, nodes, (_shares_note(graph, pipeline),), pipeline=pipeline)


def pas_hybrid(graph: Graph, cfg: ComputeConfig) -> Plan:
    """Pipeline stages over `pp_size` device groups, each stage split by the `tp` policy inside its group."""
    opts = HybridOptions.from_pas_config(cfg.pas_config, strict=False)
    cp = context_parallel_of(opts)
    cp_size = cp.size if cp else opts.ep_size  # the devices a stage's tp plan is multiplied by
    per_group = 2 if opts.pipeline_scheduler in V_SHAPED else 1  # zbv / dualpipev: two stages per group
    nstages = _nstages(opts) or (opts.pp_size or cfg.plan_ngpus // cp_size) * per_group
    pp_size = opts.pp_size or nstages // per_group
    if cfg.plan_ngpus % pp_size or nstages % pp_size:
        raise PlanError(
            f"policy 'hybrid': pp_size ({pp_size}) must divide plan_ngpus ({cfg.plan_ngpus}) and "
            f"pipeline_nstages ({nstages})"
        )
    if opts.ep_size > 1:
        check_ep_size(opts.ep_size, cfg.plan_ngpus // pp_size, cp, "hybrid")
    if (cfg.plan_ngpus // pp_size) % cp_size:
        raise PlanError(
            f"policy 'hybrid': cp_size ({cp_size}) must divide each stage's devices (plan_ngpus // pp_size = "
            f"{cfg.plan_ngpus // pp_size})"
        )
    tp = cfg.plan_ngpus // pp_size // cp_size
    pipeline = _pipeline(graph, cfg, opts, pp_size, nstages)
    nodes: dict[str, NodePlan] = {}
    notes: list[str] = [_shares_note(graph, pipeline)]
    starts = [i for i, n in enumerate(graph.nodes) if n.name in set(pipeline.starts)]
    tp_only = {k: v for k, v in (cfg.pas_config or {}).items() if not k.startswith(("cp_", "ep_"))}
    stage_cfg = ComputeConfig(tp, tp, pas_config=tp_only)
    for piece in cut_graph(graph, starts):
        sub = pas_tp(piece.graph, stage_cfg)
        nodes.update(sub.nodes)
        notes.extend(f"stage {piece.index}: {n}" for n in sub.notes)
    plan = Plan("hybrid", cfg.plan_ngpus // cp_size, nodes, tuple(notes), pipeline=pipeline)
    if opts.ep_size > 1:
        return with_expert_parallel(graph, plan, opts.ep_size)
    return with_context_parallel(graph, plan, cp) if cp else plan


def validate_pipeline(graph: Graph, plan: Plan, cfg: ComputeConfig) -> None:
    """Check a plan's pipeline part (also for plans from user policies)."""
    p = plan.pipeline
    if p is None:
        return
    if not cfg.use_end2end:
        raise PlanError("the plan has pipeline stages but ComputeConfig.use_end2end is False; set it to True")
    check_end2end_loss(graph)
    if cfg.use_zero and cfg.zero_stage == 3:
        raise PlanError(
            "ZeRO stage 3 does not run with pipeline stages yet (parameters are gathered around forward calls, "
            "which pipeline stages do not make): use zero_stage=1 or 2 with pipelines"
        )
    if p.pp_size < 1 or cfg.plan_ngpus % p.pp_size or p.nstages % p.pp_size:
        raise PlanError(
            f"pipeline: pp_size {p.pp_size} must divide plan_ngpus ({cfg.plan_ngpus}) and the {p.nstages} stages"
        )
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    idx = [order.get(s) for s in p.starts]
    if None in idx or idx[0] != 0 or idx != sorted(set(idx)):
        raise PlanError(
            f"pipeline stage starts {list(p.starts)} must be node names in graph order, the first being "
            f"{graph.nodes[0].name}"
        )
    if p.scheduler not in SCHEDULERS:
        raise PlanError(f"pipeline scheduler {p.scheduler!r}: use one of {list(SCHEDULERS)}")
    simulate(p.scheduler, p.nstages, p.pp_size, p.nmicros)
    check_nccl(p.scheduler, p.nstages, p.pp_size, p.nmicros)
