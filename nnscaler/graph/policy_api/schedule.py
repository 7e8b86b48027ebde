"""nnScaler 0.8's PredefinedSched: attach a pipeline schedule to a staged IRGraph (recorded; the
schedules we run are nnscaler.policies.plan.SCHEDULERS, others are refused when the plan is made)."""

from __future__ import annotations

from nnscaler.graph.policy_api.irgraph import IRGraph
from nnscaler.graph.policy_api.record import ScheduleRecord

__all__ = ["PredefinedSched", "SchedulePlan"]

SchedulePlan = ScheduleRecord
"""What `graph.sched` holds once a schedule is bound (nnScaler's SchedulePlan)."""


def _bind(name: str, graph: IRGraph, num_microbatches: int, num_stages: int) -> ScheduleRecord:
    call = f"PredefinedSched.sched_{name}(graph, {num_microbatches}, {num_stages})"
    graph.bind_pipeline_schedule(num_stages, num_microbatches, name, call)
    return graph.sched


class PredefinedSched:
    """nnScaler's predefined schedules, by name: sched_<name>(graph, num_microbatches, num_stages)."""

    @staticmethod
    def sched_1f1b(graph: IRGraph, num_microbatches: int, num_stages: int) -> ScheduleRecord:
        return _bind("1f1b", graph, num_microbatches, num_stages)

    @staticmethod
    def sched_gpipe(graph: IRGraph, num_microbatches: int, num_stages: int) -> ScheduleRecord:
        return _bind("gpipe", graph, num_microbatches, num_stages)

    @staticmethod
    def sched_1f1b_interleaved(graph: IRGraph, num_microbatches: int, num_stages: int) -> ScheduleRecord:
        return _bind("1f1b_interleaved", graph, num_microbatches, num_stages)

    @staticmethod
    def sched_1f1b_plus(graph: IRGraph, num_microbatches: int, num_stages: int) -> ScheduleRecord:
        return _bind("1f1b_plus", graph, num_microbatches, num_stages)

    @staticmethod
    def sched_chimera_direct(graph: IRGraph, num_microbatches: int, num_stages: int) -> ScheduleRecord:
        return _bind("chimera_direct", graph, num_microbatches, num_stages)

    @staticmethod
    def sched_infer_pipe(graph: IRGraph, num_microbatches: int, num_stages: int) -> ScheduleRecord:
        return _bind("infer_pipe", graph, num_microbatches, num_stages)
