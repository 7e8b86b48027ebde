"""nnScaler 0.8's `nnscaler.ir.cten` import path."""

from nnscaler.graph.policy_api import IRCell, IRObject, IRTensor

__all__ = ["IRCell", "IRObject", "IRTensor"]
