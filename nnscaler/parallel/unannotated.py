"""Ops with no annotation: replicated with a warning when that is correct, rejected otherwise."""

from __future__ import annotations

import warnings

import torch

from nnscaler.errors import TraceError
from nnscaler.graph.ir import Graph
from nnscaler.graph.ops import get_rule
from nnscaler.graph.ops.leaf import is_leaf_op

__all__ = ["check_unannotated", "UnannotatedOpWarning"]


class UnannotatedOpWarning(UserWarning):
    """An op has no annotation and is kept whole on every device."""


def _resolve(op: str):
    namespace, _, rest = op.partition(".")
    name, _, overload = rest.rpartition(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), name), overload)
    except AttributeError:
        return None


def _replication_invalid(op: str) -> str | None:
    """Why computing the op whole on every device would be wrong (None when it is fine)."""
    overload = _resolve(op)
    if overload is None:
        return None
    schema = overload._schema
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return "it writes to its inputs in place, so replicas would update their copies independently"
    if torch.Tag.nondeterministic_seeded in getattr(overload, "tags", ()):
        return "it draws random numbers, so replicas would not agree"
    return None


def check_unannotated(graph: Graph) -> None:
    """Warn once per op kept whole; raise TraceError where replication cannot be correct."""
    seen: set[str] = set()
    for node in graph.nodes:
        if get_rule(node.op) is not None or node.op in seen:
            continue
        if is_leaf_op(node.op):  # an opaque leaf module: warned about at capture
            continue
        why = _replication_invalid(node.op)
        if why:
            raise TraceError(
                f"op {node.op} at {node.source or 'unknown source'} (node {node.name}) has no annotation and "
                f"cannot be replicated: {why}. Register it with nnscaler.register_op('<annotation>') "
                "(see docs/annotations.md), e.g. '* h, * h -> * h' for an elementwise op."
            )
        seen.add(node.op)
        warnings.warn(
            f"op {node.op} at {node.source or 'unknown source'} has no annotation: kept whole on every device. "
            "Register it with nnscaler.register_op to let it split.",
            UnannotatedOpWarning,
            stacklevel=3,
        )
