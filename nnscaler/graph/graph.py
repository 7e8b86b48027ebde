"""nnScaler 0.8's `nnscaler.graph.graph` import path: IRGraph (the policy API front)."""

from nnscaler.graph.policy_api import IRGraph

__all__ = ["IRGraph"]
