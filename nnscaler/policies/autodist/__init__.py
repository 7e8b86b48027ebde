"""autodist: the searched plan (how it works and how to steer it: docs/autodist.md).

The modules, in the order they build on one another: devices (device table) -> cluster (YAML) -> comm
(alpha-beta collectives) -> cost, memory (models) -> choices (candidate partitions per node) ->
spmd_problem, spmd_program, spmd (the integer program: its data, its PuLP form, solve and decode) ->
context (the planner's inputs and per-stage costs), candidate (a scored configuration) -> evaluate
(cost given plans) -> search (pipeline x tp x micro-batches x recompute, pipeline_dp: stage DP in C++)
-> policy (`pas_autodist`, saving and loading plans with plan_files); recipes (standard recipes under the
same model), report (plan_report.md, with report_words: splits in words, report_reasons: why a faster
recipe was not taken) and offline (a whole cluster's plan) sit on top.
"""

from __future__ import annotations

from nnscaler.policies.autodist.cluster import ClusterSpec, LinkSpec, load_cluster, shipped_clusters
from nnscaler.policies.autodist.context import PlannerSetup
from nnscaler.policies.autodist.devices import DEVICES, DeviceSpec, get_device
from nnscaler.policies.autodist.plan_files import load_plan, save_plan
from nnscaler.policies.autodist.policy import pas_autodist, planner_setup
from nnscaler.policies.autodist.search import search
from nnscaler.policies.autodist.spmd import SpmdResult, solve_spmd

__all__ = [
    "ClusterSpec",
    "LinkSpec",
    "load_cluster",
    "shipped_clusters",
    "DEVICES",
    "DeviceSpec",
    "get_device",
    "load_plan",
    "save_plan",
    "pas_autodist",
    "planner_setup",
    "PlannerSetup",
    "search",
    "SpmdResult",
    "solve_spmd",
]
