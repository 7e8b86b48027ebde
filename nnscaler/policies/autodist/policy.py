"""`pas_policy='autodist'`: search the plan (SPMD partition x pipeline) with the analytic cost model
for the cluster in pas_config['cluster'], honouring the constraints in pas_config."""

from __future__ import annotations

import logging
from dataclasses import replace

from nnscaler.config import ComputeConfig
from nnscaler.errors import PlanError
from nnscaler.graph.ir import Graph
from nnscaler.policies.autodist.candidate import Candidate
from nnscaler.policies.autodist.cluster import ClusterSpec, LinkSpec, load_cluster
from nnscaler.policies.autodist.constraints import PartitionConstraints, load_constraints
from nnscaler.policies.autodist.context import PlannerSetup
from nnscaler.policies.autodist.cost import traced_batch_size
from nnscaler.policies.autodist.cp_search import plan_with_cp
from nnscaler.policies.autodist.ep_search import ep_setup, with_ep
from nnscaler.policies.autodist.memory import MemoryModel
from nnscaler.policies.autodist.plan_files import load_plan, save_plan
from nnscaler.policies.autodist.schedule_choice import searched_schedules
from nnscaler.policies.autodist.search import search
from nnscaler.policies.options import AutodistOptions
from nnscaler.policies.plan import NodePlan, PipelinePlan, Plan
from nnscaler.policies.recompute import recompute_paths
from nnscaler.policies.stage_balance import stage_summary
from nnscaler.policies.staging import parse_pivots
from nnscaler.runtime.grads.buckets import DEFAULT_BUCKET_CAP_MB

__all__ = ["pas_autodist", "planner_setup", "plan_from_candidate", "default_cluster"]

_log = logging.getLogger(__name__)


def default_cluster() -> ClusterSpec:
    """This machine: its GPU kind in an 8-device node when CUDA is present, else CPU over gloo."""
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name().lower()
        kind = next((k for k in ("h200", "h100", "a100", "mi300x") if k in name), "h100")
        return load_cluster(
            {"device": kind, "nodes": 1, "devices_per_node": max(torch.cuda.device_count(), 1)}
        )
    return load_cluster("cpu_gloo")


def planner_setup(
    graph: Graph, cfg: ComputeConfig, opts: AutodistOptions | None = None, cluster: ClusterSpec | None = None
) -> PlannerSetup:
    """The search's inputs from a ComputeConfig and its pas_config (`cluster` overrides pas_config's)."""
    opts = opts or AutodistOptions.from_pas_config(cfg.pas_config, strict=False)
    if cluster is None:
        cluster = load_cluster(opts.cluster) if opts.cluster else default_cluster()
    db = _profile_db(opts.profile_db_path)
    if db is not None:  # measured links replace the cluster file's
        links = {k: LinkSpec(v["bandwidth_gbs"], v["latency_us"]) for k, v in db.links.items()}
        cluster = replace(cluster, **links)
    zero = opts.zero_stage if opts.zero_stage is not None else (cfg.zero_stage if cfg.use_zero else 0)
    if zero not in (0, 1, 2, 3):
        raise PlanError(f"pas_config['zero_stage'] must be 0, 1, 2 or 3, got {zero!r}")
    dtype = "bfloat16" if opts.use_bf16 else ("float16" if opts.use_fp16 else None)
    memory = MemoryModel(zero, mixed_precision=dtype is not None, transient_mem_coef=opts.transient_mem_coef)
    limit_gb = opts.mem_constraint if opts.mem_constraint is not None else 0.8 * cluster.device.memory_gb
    constraints = (
        load_constraints(opts.partition_constraints) if opts.partition_constraints else PartitionConstraints()
    )
    if opts.partition_constraints_path:
        more = load_constraints(opts.partition_constraints_path)
        constraints = PartitionConstraints(constraints.rules + more.rules)
    if opts.pipeline_stages:
        raise PlanError(
            "pas_config['pipeline_stages'] is not read by autodist (it places stages itself): give "
            "pipeline_nstages and pipeline_pivots to constrain it, or use policy 'hybrid'"
        )
    return PlannerSetup(
        cluster=cluster,
        plan_ngpus=cfg.plan_ngpus,
        dp_size=cfg.runtime_ngpus // cfg.plan_ngpus,
        memory=memory,
        mem_limit=limit_gb * 1e9,
        constraints=constraints,
        recompute=recompute_paths(graph, opts.recompute_modules),
        pivots=parse_pivots(opts.pipeline_pivots) or None,
        training=not cfg.inference_only,
        compute_dtype=dtype,
        traced_batch=traced_batch_size(graph),
        solver=opts.solver,
        end2end=cfg.use_end2end,
        nstages=None if opts.pipeline_nstages == "auto" else opts.pipeline_nstages,
        nmicros=opts.pipeline_nmicros,
        schedulers=searched_schedules(opts.pipeline_scheduler),
        measured=db.entries if db is not None else None,
        step_overhead=db.step_overhead_s if db is not None else 0.0,
        free_op=db.free_op_s if db is not None else 0.0,
        bucket_bytes=(cfg.reducer_bucket_cap_mb or DEFAULT_BUCKET_CAP_MB) * 2**20,
        tp_mesh=_tp_mesh(opts.tp_mesh),
        cp_size=None if opts.cp_size == "auto" else opts.cp_size,
        cp_kind=None if opts.cp_kind == "auto" else opts.cp_kind,
        cp_ulysses_size=opts.cp_ulysses_size,
        ep_size=None if opts.ep_size == "auto" else opts.ep_size,
    )


def _tp_mesh(value) -> str | tuple[int, ...]:
    if value in ("auto", "off"):
        return value
    if (
        isinstance(value, (list, tuple))
        and len(value) in (2, 3)
        and all(isinstance(v, int) and v > 1 for v in value)
    ):
        return tuple(value)
    raise PlanError(
        f"pas_config['tp_mesh'] must be 'auto', 'off', [a, b] or [a, b, c] with each > 1, got {value!r}"
    )


def _profile_db(path: str | None):
    """The measured database at pas_config['profile_db_path'] (profiler.ProfileDB), or None."""
    if not path:
        return None
    from pathlib import Path

    from nnscaler.policies.autodist.profiler import ProfileDB

    if not Path(path).exists():
        raise PlanError(
            f"pas_config['profile_db_path'] = {path!r}: no such file (write one with profile_graph)"
        )
    db = ProfileDB.load(path)
    unknown = sorted(set(db.links) - {"intra_node", "inter_node"})
    if unknown:
        raise PlanError(
            f"pas_config['profile_db_path'] = {path!r}: links {unknown} are not cluster links "
            "(use 'intra_node' or 'inter_node')"
        )
    return db


def plan_from_candidate(
    graph: Graph, cand: Candidate, setup: PlannerSetup, scheduler: str | None = None
) -> Plan:
    """The Plan of a scored configuration (with context parallelism: cp_search.plan_with_cp; with
    expert parallelism: ep_search.with_ep); its pipeline runs `scheduler` (default: the candidate's)."""
    scheduler = scheduler or cand.scheduler
    if cand.ep > 1 or cand.ep_rejected:
        return with_ep(graph, _plan(graph, cand, ep_setup(setup, cand.ep), scheduler), cand)
    return _plan(graph, cand, setup, scheduler)


def _plan(graph: Graph, cand: Candidate, setup: PlannerSetup, scheduler: str) -> Plan:
    if cand.cp is not None or cand.cp_rejected:
        return plan_with_cp(graph, cand, setup, lambda sub: _tp_plan(graph, cand, sub, scheduler))
    return _tp_plan(graph, cand, setup, scheduler)


def _tp_plan(graph: Graph, cand: Candidate, setup: PlannerSetup, scheduler: str) -> Plan:
    nodes = {name: _bare(p) for name, p in cand.spmd.plans.items()}
    mesh = cand.spmd.mesh if any(p.mesh_splits for p in nodes.values()) else ()
    pipeline = None
    if cand.pp > 1:
        pipeline = PipelinePlan(
            tuple(graph.nodes[i].name for i in cand.starts),
            cand.pp,
            cand.nmicros,
            scheduler,
            tuple(setup.pivots or ()),
        )
    note = (
        f"autodist: {cand.label()} on {setup.cluster.name or setup.cluster.device.name}; predicted "
        f"{cand.step_time * 1e3:.3f} ms per step, {cand.memory / 1e9:.3f} GB on the fullest device"
    )
    notes = (note, f"pipeline {stage_summary(graph, cand.starts)}") if cand.pp > 1 else (note,)
    if cand.pp > 1:
        _log.info("autodist: %s", notes[1])
    return Plan("autodist", setup.plan_ngpus, nodes, notes, tuple(cand.recompute_paths), pipeline, mesh)


def _bare(p: NodePlan) -> NodePlan:
    """The plan's split without the search's notes (replicate where nothing is split)."""
    if p.mesh_splits:
        return NodePlan(mesh_splits=p.mesh_splits)
    return NodePlan(p.split, p.ways, p.blocks) if p.is_split else NodePlan()


def pas_autodist(graph: Graph, cfg: ComputeConfig) -> Plan:
    """The searched plan (see the module docstring and docs/autodist.md)."""
    opts = AutodistOptions.from_pas_config(cfg.pas_config, strict=False)
    if opts.load_plan_path:
        plan = load_plan(opts.load_plan_path, graph, cfg.plan_ngpus)
        return replace(plan, policy="autodist")
    setup = planner_setup(graph, cfg, opts)
    best, _ = search(graph, setup)
    plan = plan_from_candidate(graph, best, setup)
    if opts.save_plan_path:
        save_plan(
            plan,
            opts.save_plan_path,
            {
                "config": best.label(),
                "step_seconds": best.step_time,
                "memory_bytes": best.memory,
                "cluster": setup.cluster.name,
            },
        )
    return plan
