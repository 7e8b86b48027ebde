"""Offline planning: the best plan for a whole cluster (plan size and data-parallel degree searched
too), for a cluster you do not have. Used by `python -m nnscaler.plan`."""

from __future__ import annotations

from dataclasses import dataclass, replace

from nnscaler.config import ComputeConfig
from nnscaler.errors import PlanError
from nnscaler.graph.ir import Graph
from nnscaler.policies.autodist.cluster import ClusterSpec
from nnscaler.policies.autodist.policy import plan_from_candidate, planner_setup
from nnscaler.policies.autodist.search import Candidate, PlannerSetup, divisors, search
from nnscaler.policies.plan import Plan

__all__ = ["OfflinePlan", "plan_offline"]


@dataclass
class OfflinePlan:
    plan: Plan
    best: Candidate
    setup: PlannerSetup
    scored: list[Candidate]
    """The best configuration of every plan size tried."""
    seconds: float = 0.0


def plan_offline(
    graph: Graph,
    cluster: ClusterSpec,
    ndevices: int | None = None,
    *,
    plan_ngpus: int | None = None,
    end2end: bool = True,
    pas_config: dict | None = None,
    max_plan_ngpus: int | None = None,
) -> OfflinePlan:
    """Search plan_ngpus (each a divisor of ndevices; the rest is data parallel) x the plan itself.

    The traced batch is the global batch of one micro-step: with dp replicas each takes 1/dp of it.
    Tensor parallelism stays inside a node (larger plans are pipelines of node-sized stages).
    """
    import time

    t0 = time.perf_counter()
    ndevices = ndevices or cluster.ndevices
    pas = {k: v for k, v in (pas_config or {}).items() if k != "cluster"}
    sizes = (
        [plan_ngpus] if plan_ngpus else [d for d in divisors(ndevices) if d <= (max_plan_ngpus or ndevices)]
    )
    results: list[tuple[Candidate, PlannerSetup]] = []
    errors = []
    for p in sizes:
        cfg = ComputeConfig(p, ndevices, use_end2end=end2end, pas_config=pas)
        setup = planner_setup(graph, cfg, cluster=cluster)
        setup = replace(setup, batch_scale=setup.batch_scale / setup.dp_size, max_tp=cluster.devices_per_node)
        try:
            best, _ = search(graph, setup)
        except PlanError as exc:
            errors.append(f"plan_ngpus={p}: {exc}")
            continue
        results.append((best, setup))
    if not results:
        raise PlanError("no plan fits: " + "; ".join(errors))
    best, setup = min(results, key=lambda r: (r[0].time_per_micro, r[0].pp, r[1].plan_ngpus))
    plan = plan_from_candidate(graph, best, setup)
    return OfflinePlan(plan, best, setup, [c for c, _ in results], time.perf_counter() - t0)
