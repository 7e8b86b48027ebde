"""Offline planning: the best plan for a whole cluster (plan size and data-parallel degree searched
too), for a cluster you do not have. Used by `python -m nnscaler.plan`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from nnscaler.config import ComputeConfig
from nnscaler.errors import PlanError
from nnscaler.graph.ir import Graph
from nnscaler.policies.autodist.candidate import Candidate
from nnscaler.policies.autodist.cluster import ClusterSpec
from nnscaler.policies.autodist.context import PlannerSetup
from nnscaler.policies.autodist.policy import plan_from_candidate, planner_setup
from nnscaler.policies.autodist.search import divisors, micro_options, search
from nnscaler.policies.context_parallel import attention_nodes
from nnscaler.policies.option_checks import check_options
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
    phases: list[tuple[str, float]] = field(default_factory=list)
    """(outer choice 'plan_ngpus=8 zero=2 nmicros=4', seconds its search took), in search order."""


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

    The traced batch is the global batch of one step: dp replicas x nmicros micro-batches share it
    (the micro-batch count is searched too, unless pas_config fixes pipeline_nmicros).
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
    phases: list[tuple[str, float]] = []
    errors = []
    for p in sizes:
        cfg = ComputeConfig(p, ndevices, use_end2end=end2end, pas_config=pas)
        try:  # a value that cannot apply at this plan size (a pinned tp_mesh, ...): refused, named
            check_options("autodist", cfg, graph)
        except PlanError as exc:
            if len(sizes) == 1:
                raise
            errors.append(f"plan_ngpus={p}: {exc}")
            continue
        base = planner_setup(graph, cfg, cluster=cluster)
        base = replace(base, max_tp=cluster.devices_per_node, global_batch=True)
        if base.dp_size > max(base.traced_batch, 1):  # a replica needs a whole sample (cp splits sequences)
            errors.append(
                f"plan_ngpus={p}: {base.dp_size} data-parallel replicas for a batch of {base.traced_batch}"
            )
            continue
        # ZeRO: stage 2 costs what stage 1 does and keeps less; stage 3 (no pipelines) trades an
        # all-gather for parameter memory. A stage given in pas_config is kept.
        # Under context parallelism ZeRO shards over cp x dp, so it is searched where cp may be too.
        sharded = base.dp_size > 1 or (base.cp_size != 1 and p > 1 and bool(attention_nodes(graph)))
        zeros = [base.memory.zero_stage] if "zero_stage" in pas or not sharded else [2, 3]
        for zero, m in [(z, m) for z in zeros for m in micro_options(base, base.dp_size)]:
            setup = replace(
                base,
                nmicros=m,
                batch_scale=1.0 / (base.dp_size * m),
                memory=replace(base.memory, zero_stage=zero),
                nstages=1 if zero == 3 else base.nstages,
            )
            t1 = time.perf_counter()
            try:
                best, _ = search(graph, setup)
            except PlanError as exc:
                errors.append(f"plan_ngpus={p} nmicros={m} zero={zero}: {exc}")
                continue
            finally:
                phases.append((f"plan_ngpus={p} zero={zero} nmicros={m}", time.perf_counter() - t1))
            results.append((best, setup))
    if not results:
        raise PlanError("no plan fits: " + "; ".join(errors))
    best, setup = min(results, key=lambda r: (r[0].step_time, r[0].pp, r[1].plan_ngpus))
    plan = plan_from_candidate(graph, best, setup)
    return OfflinePlan(plan, best, setup, [c for c, _ in results], time.perf_counter() - t0, phases)
