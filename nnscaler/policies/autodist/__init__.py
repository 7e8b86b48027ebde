"""autodist: the searched plan (DESIGN.md §5, docs/autodist.md).

devices (device table) -> cluster (YAML) -> comm (alpha-beta collectives) -> cost, memory (models)
-> choices (candidate partitions per node) -> spmd (integer program) -> pipeline_dp (stage DP, C++)
-> search (pipeline x tp x micro-batches x recompute) -> policy (`pas_autodist`); planio (save and
load), evaluate and recipes (cost given plans), report (plan_report.md).
"""

from __future__ import annotations

from nnscaler.policies.autodist.cluster import ClusterSpec, LinkSpec, load_cluster, shipped_clusters
from nnscaler.policies.autodist.devices import DEVICES, DeviceSpec, get_device
from nnscaler.policies.autodist.planio import load_plan, save_plan
from nnscaler.policies.autodist.policy import pas_autodist, planner_setup
from nnscaler.policies.autodist.search import PlannerSetup, search
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
