"""`torch.ops.nnscaler.moe_experts`: a mixture-of-experts layer's experts as one op.

Capture replaces a recognised experts module's forward by this op (nnscaler.graph.capture.moe), so
the layer traces as one node the planner can split on its expert dim; its eager implementation is
`local_experts` (exact, on one device), and its backward recomputes that forward under autograd.
Split over an expert-parallel group, generated code calls `expert_parallel_experts` instead
(nnscaler.runtime.moe.dispatch).
"""

from __future__ import annotations

from typing import Any

import torch

from nnscaler.runtime.moe.dispatch import record_routing
from nnscaler.runtime.moe.experts import local_experts

__all__ = ["moe_experts", "MOE_OP"]

MOE_OP = "nnscaler.moe_experts.default"
"""The op's name in the captured graph."""


@torch.library.custom_op("nnscaler::moe_experts", mutates_args=())
def moe_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    activation: str,
    capacity_factor: float | None = None,
) -> torch.Tensor:
    """hidden [T, H], top_k_index / top_k_weights [T, K], gate_up_proj [E, 2I, H], down_proj [E, H, I]
    -> [T, H] (see nnscaler.runtime.moe.experts)."""
    record_routing(top_k_index)
    return local_experts(
        hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, capacity_factor
    )


@moe_experts.register_fake
def _fake(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, capacity_factor=None):
    return torch.empty_like(hidden)


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    hidden, index, weights, gate_up, down, act, factor = inputs
    ctx.save_for_backward(hidden, index, weights, gate_up, down)
    ctx.act, ctx.factor = act, factor


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    hidden, index, weights, gate_up, down = ctx.saved_tensors
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in (hidden, weights, gate_up, down)]
        out = local_experts(leaves[0], index, leaves[1], leaves[2], leaves[3], ctx.act, ctx.factor)
        got = torch.autograd.grad(out, leaves, grad, allow_unused=True)
    return got[0], None, got[1], got[2], got[3], None, None


moe_experts.register_autograd(_backward, setup_context=_setup_context)
