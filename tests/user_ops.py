"""User ops for the register_op tests (an importable module: generated code imports it)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import nnscaler


@torch.library.custom_op("nntest::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.tanh(x) * scale


@scaled_tanh.register_fake
def _(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(x)


def _scaled_tanh_setup(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.scale = inputs[1]


def _scaled_tanh_backward(ctx, grad):
    (out,) = ctx.saved_tensors
    return grad * (ctx.scale - out * out / ctx.scale), None


scaled_tanh.register_autograd(_scaled_tanh_backward, setup_context=_scaled_tanh_setup)
nnscaler.register_op("* h -> * h")(scaled_tanh)


@nnscaler.register_op("* h, * h -> * h")
def swiglu(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """A plain function: register_op makes it one traced node with autograd from torch.func."""
    return F.silu(gate) * x


def _emit_with_rank(node, args, kwargs, runtime_devid, plan_ndevs, runtime_ndevs) -> str:
    """register_op's emit_fn: the call gets the rank its code is generated for (nnScaler's ring
    attention hands its ranks to the op this way)."""
    return f"{node.signature}({', '.join(args)}, rank={runtime_devid}, nranks={runtime_ndevs})"


@nnscaler.register_op("* h, * h -> * h", emit_fn=_emit_with_rank)
def rank_checked_mul(x: torch.Tensor, y: torch.Tensor, rank: int = -1, nranks: int = 0) -> torch.Tensor:
    """x * y; in generated code, also checks it runs on the rank its call was written for."""
    if nranks and (dist.get_rank(), dist.get_world_size()) != (rank, nranks):
        raise RuntimeError(f"code written for rank {rank} of {nranks} runs on rank {dist.get_rank()}")
    return x * y


class EmitOpMLP(nn.Module):
    """An MLP whose gate multiplication is an op with an emit_fn."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.gate = nn.Linear(16, 32)
        self.down = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.down(rank_checked_mul(self.up(x), torch.sigmoid(self.gate(x)))), y)


class UserOpMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.gate = nn.Linear(16, 32)
        self.down = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = scaled_tanh(swiglu(self.up(x), self.gate(x)), 2.0)
        return F.mse_loss(self.down(h), y)
