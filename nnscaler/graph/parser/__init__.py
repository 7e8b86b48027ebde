"""nnScaler 0.8's `nnscaler.graph.parser` import paths (op registration, the parser's logger)."""

from nnscaler.graph.parser.register import register_op

__all__ = ["register_op"]
