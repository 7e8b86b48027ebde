"""Policies: functions (graph, compute_config) -> Plan. Built-ins: dp, data, tp, pp, hybrid, autodist."""

from __future__ import annotations

import dataclasses
import math

from nnscaler.config import ComputeConfig
from nnscaler.errors import PlanError
from nnscaler.graph.ir import Graph
from nnscaler.graph.ops import annotate_node, get_rule, layouts_for, mesh_layouts_for
from nnscaler.policies.builtin import pas_autodist, pas_data, pas_dp
from nnscaler.policies.option_checks import check_pas_config
from nnscaler.policies.pipeline import check_end2end_loss, pas_hybrid, pas_pp, validate_pipeline
from nnscaler.policies.plan import REPLICATE, NodePlan, PipelinePlan, Plan
from nnscaler.policies.policy_api08 import run_policy
from nnscaler.policies.recompute import recompute_paths
from nnscaler.policies.registry import BUILTIN_POLICIES, Policy, resolve_policy, validate_pas_config
from nnscaler.policies.tp import pas_tp

__all__ = [
    "NodePlan",
    "PipelinePlan",
    "Plan",
    "REPLICATE",
    "BUILTIN_POLICIES",
    "resolve_policy",
    "validate_pas_config",
    "make_plan",
    "validate_plan",
    "Policy",
    "pas_dp",
    "pas_data",
    "pas_tp",
    "pas_pp",
    "pas_hybrid",
    "pas_autodist",
]


def validate_plan(graph: Graph, plan: Plan, cfg: ComputeConfig) -> None:
    """Check every split against the annotation and the device count; raise PlanError naming the node."""
    if plan.plan_ngpus != cfg.plan_ngpus:
        raise PlanError(
            f"plan is for {plan.plan_ngpus} devices but ComputeConfig.plan_ngpus is {cfg.plan_ngpus}"
        )
    validate_pipeline(graph, plan, cfg)
    ways = plan.tp_size
    names = {n.name for n in graph.nodes}
    unknown = sorted(set(plan.nodes) - names)
    if unknown:
        raise PlanError(f"plan names nodes the graph does not have: {unknown[:5]}")
    if plan.mesh and (math.prod(plan.mesh) != ways or min(plan.mesh) < 1):
        raise PlanError(f"plan mesh {plan.mesh} must multiply to the {ways} devices each stage is split over")
    for node in graph.nodes:
        np = plan.node(node.name)
        if np.mesh_splits:
            _validate_mesh_split(graph, plan, node, np)
            continue
        if np.split is None or np.ways == 1:
            continue
        if np.ways != ways:
            where = "the devices of its pipeline stage" if plan.pipeline else "plan devices"
            raise PlanError(
                f"node {node.name} ({node.op}, {node.source}) is split {np.ways} ways; splits must use all "
                f"{ways} {where}"
            )
        bound = annotate_node(node, graph)
        if bound is None:
            raise PlanError(
                f"node {node.name} ({node.op}, {node.source}) has no annotation and cannot be split"
            )
        result = layouts_for(bound, get_rule(node.op), np.split, np.ways, np.blocks)
        if isinstance(result, str):
            raise PlanError(
                f"plan splits node {node.name} ({node.op}, annotation '{bound}') at {node.source or 'unknown source'} "
                f"on {np.split!r} {np.ways} ways: {result}"
            )


def _validate_mesh_split(graph: Graph, plan: Plan, node, np) -> None:
    where = f"node {node.name} ({node.op}, {node.source or 'unknown source'})"
    if not plan.mesh:
        raise PlanError(f"{where} has mesh_splits but the plan has no mesh: set Plan.mesh, e.g. (2, 2)")
    bound = annotate_node(node, graph)
    if bound is None:
        raise PlanError(f"{where} has no annotation and cannot be split")
    result = mesh_layouts_for(bound, get_rule(node.op), np.mesh_splits, plan.mesh)
    if isinstance(result, str):
        raise PlanError(
            f"plan splits {where}, annotation '{bound}', as {np.describe()} over mesh {plan.mesh}: {result}"
        )


def make_plan(graph: Graph, policy: str | Policy, cfg: ComputeConfig) -> Plan:
    name, fn = resolve_policy(policy)
    check_pas_config(fn, cfg, graph)  # built-in policies: refuse values that cannot apply (issue 41)
    if cfg.use_end2end:
        check_end2end_loss(graph)
    plan = run_policy(fn, graph, cfg)  # ours, or nnScaler 0.8's IRGraph policy API (recorded)
    if not isinstance(plan, Plan):
        raise PlanError(f"policy {name} returned {type(plan).__name__}, expected nnscaler.policies.Plan")
    validate_plan(graph, plan, cfg)
    recompute = recompute_paths(graph, cfg.pas_config.get("recompute_modules"))
    if recompute and not plan.recompute:
        plan = dataclasses.replace(plan, recompute=recompute)
    return plan
