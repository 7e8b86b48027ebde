"""nnScaler 0.8's `nnscaler.graph.segment` import path: IRSegment (a pipeline stage of the policy API)."""

from nnscaler.graph.policy_api import IRSegment

__all__ = ["IRSegment"]
