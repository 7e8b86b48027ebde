"""User ops for the register_op tests (an importable module: generated code imports it)."""

from __future__ import annotations

import torch
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


class UserOpMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.gate = nn.Linear(16, 32)
        self.down = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = scaled_tanh(swiglu(self.up(x), self.gate(x)), 2.0)
        return F.mse_loss(self.down(h), y)
