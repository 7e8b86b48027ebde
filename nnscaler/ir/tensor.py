"""nnScaler 0.8's `nnscaler.ir.tensor` import path."""

from nnscaler.graph.policy_api import IRFullTensor, IRSubTensor

__all__ = ["IRFullTensor", "IRSubTensor"]
