"""nnScaler 0.8's `nnscaler.graph.parser.register` import path: register_op (nnscaler.register_op)."""

from nnscaler.graph.ops import register_op

__all__ = ["register_op"]
