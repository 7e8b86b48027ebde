"""nnScaler 0.8's `nnscaler.graph.schedule.predefined` import path."""

from nnscaler.graph.policy_api import PredefinedSched

__all__ = ["PredefinedSched"]
