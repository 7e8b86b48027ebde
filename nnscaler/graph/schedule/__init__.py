"""nnScaler 0.8's `nnscaler.graph.schedule` import paths (predefined schedules of the policy API)."""

from nnscaler.graph.policy_api import SchedulePlan

__all__ = ["SchedulePlan"]
