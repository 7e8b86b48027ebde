"""The op of an opaque leaf module (graph/capture/leaf_modules.py): no annotation, kept whole.

Its node runs one submodule eagerly: the plan replicates it (an op without a rule), codegen writes a
call of `nnscaler.runtime.leaf.call`, and the compile warns about it once, at capture.
"""

from __future__ import annotations

__all__ = ["LEAF_OP", "is_leaf_op"]

LEAF_OP = "nnscaler_leaf.call.default"


def is_leaf_op(op: str) -> bool:
    """Whether the op is an opaque leaf module's call."""
    return op == LEAF_OP
