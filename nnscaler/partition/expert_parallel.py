"""The local code of the experts op split on its expert dim: a call into the runtime's expert
parallelism (all-to-all dispatch and return around the rank's experts)."""

from __future__ import annotations

from nnscaler.graph.ir import Node
from nnscaler.graph.ops.moe import EXPERT_PARALLEL
from nnscaler.partition.local_ops import group_of
from nnscaler.partition.program import Statement

__all__ = ["expert_parallel_statement", "EP_CALL"]

EP_CALL = "moe.expert_parallel_experts"
"""What generated code calls (the template imports nnscaler.runtime.moe as moe)."""


def expert_parallel_statement(
    node: Node, specials: dict, args: tuple, kwargs: dict, common: dict, mesh
) -> Statement:
    """Tokens arrive split over the axis whose expert split runs the special (each rank its own), the
    weights as that rank's experts; another axis (tensor parallel on `i`) only makes the weights
    smaller, its partial sums reduced after the call as for any split."""
    axes = [k for k, sp in specials.items() if sp.emit == EXPERT_PARALLEL]
    capacity = args[6] if len(args) > 6 else kwargs.get("capacity_factor")
    call_kwargs = {"group": group_of(axes, mesh)}
    if capacity is not None:
        call_kwargs["capacity_factor"] = capacity
    return Statement("special", EP_CALL, tuple(args[:6]), call_kwargs, list(node.outputs), **common)
