"""nnScaler 0.8's `nnscaler.graph.function.anchor` import path."""

from nnscaler.graph.policy_api import IRGraphAnchor

__all__ = ["IRGraphAnchor"]
