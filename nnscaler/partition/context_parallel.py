"""The local code of attention split by sequence: a call into the runtime's context-parallel kernels."""

from __future__ import annotations

from nnscaler.errors import PartitionError
from nnscaler.graph.ir import Node
from nnscaler.graph.ops.attention import CONTEXT_PARALLEL_ATTENTION
from nnscaler.partition.local_ops import group_of
from nnscaler.partition.program import Statement
from nnscaler.policies.plan import ContextParallel, Plan

__all__ = ["context_parallel_statement", "CP_CALL"]

CP_CALL = "context_parallel.context_parallel_attention"
"""What generated code calls (the template imports nnscaler.runtime.context_parallel)."""

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


def _sdpa_options(args: tuple, kwargs: dict) -> dict:
    options = dict(zip(_SDPA_ARGS[3:], args[3:]))
    options.update(kwargs)
    return options


def context_parallel_statement(
    node: Node, plan: Plan, specials: dict, split_axes, args: tuple, kwargs: dict, common: dict, mesh
) -> Statement:
    """q, k, v (and the mask's rows) arrive as contiguous sequence chunks over the axis whose split
    runs the special; other axes (heads, batch) only make the local tensors smaller."""
    axes = [k for k, sp in specials.items() if sp.emit == CONTEXT_PARALLEL_ATTENTION]
    options = _sdpa_options(args, kwargs)
    dropout = options.get("dropout_p")
    dropout = getattr(dropout, "train", dropout)  # a ModeValue: the training value
    if dropout:
        raise PartitionError(
            f"node {node.name} ({node.op}) at {node.source or 'an unknown line'}: attention dropout "
            f"(p={dropout}) under context parallelism is not supported; set the attention "
            "dropout to 0 (e.g. config.attention_dropout = 0.0) or plan without cp_size"
        )
    cp = plan.context_parallel or ContextParallel(dict(split_axes)[axes[0]][1])
    ways = dict(split_axes)[axes[0]][1]
    if ways != cp.size:
        raise PartitionError(
            f"node {node.name} ({node.op}): the plan splits its sequence {ways} ways but its context_parallel "
            f"says {cp.size}"
        )
    call_kwargs = {k: v for k, v in options.items() if k != "dropout_p" and v is not None}
    call_kwargs = {
        k: v for k, v in call_kwargs.items() if not (k in ("is_causal", "enable_gqa") and v is False)
    }
    call_kwargs["group"] = group_of(axes, mesh)
    call_kwargs["kind"] = cp.kind
    if cp.kind == "hybrid":
        call_kwargs["ulysses_size"] = cp.ulysses_size
    return Statement("special", CP_CALL, tuple(args[:3]), call_kwargs, list(node.outputs), **common)
