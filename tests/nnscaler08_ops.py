"""Ops registered the way nnScaler 0.8's examples do, without a return annotation (swin's
`window_attn`); an importable module, since generated code imports it."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import nnscaler


@nnscaler.register_op("* h, * h -> * h")
def gated_unannotated(x: torch.Tensor, gate: torch.Tensor, scale: float):
    return F.silu(gate) * x * scale


@nnscaler.register_op("* h -> * h, * h")
def halves_unannotated(x: torch.Tensor):
    return torch.tanh(x), torch.sigmoid(x)


@nnscaler.register_op("* h -> * h")
def norm_unannotated(x: torch.Tensor):
    return x.norm().item()  # a float: refused when traced, naming this function


class UnannotatedOpMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a, b = halves_unannotated(self.up(x))
        return F.mse_loss(self.down(gated_unannotated(a, b, 2.0)), y)


class BadOpModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(x) * norm_unannotated(x)


def build(seed: int = 0):
    """The zoo builder (`tests.nnscaler08_ops:build`): the model and its batches."""
    torch.manual_seed(seed)
    model = UnannotatedOpMLP()

    def make_batch(seed: int, batch_size: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(batch_size, 16, generator=g), "y": torch.randn(batch_size, 8, generator=g)}

    return model.train(), make_batch
