"""nnScaler 0.8's `nnscaler.ir.operator` import path."""

from nnscaler.graph.policy_api import IRBpOperation, IRDataOperation, IRFwOperation

__all__ = ["IRFwOperation", "IRBpOperation", "IRDataOperation"]
