"""Tiny models for the copy tests: a MoE block whose experts follow the fused-experts contract
(graph/capture/moe.py), a model with a data-dependent submodule (an opaque leaf), and helpers that
check a copy computes with its own weights."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class Experts(nn.Module):
    """Fused experts (gate_up_proj [E, 2I, H], down_proj [E, H, I], act_fn), written as a dense loop."""

    def __init__(self, experts: int = 4, hidden: int = 8, inter: int = 6):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inter, hidden) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, inter) * 0.3)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.gate_up_proj.shape[0]):
            gate, up = (hidden_states @ self.gate_up_proj[e].T).chunk(2, -1)
            y = (self.act_fn(gate) * up) @ self.down_proj[e].T
            out = out + (top_k_weights * (top_k_index == e)).sum(-1, keepdim=True) * y
        return out


class MoeBlock(nn.Module):
    """Router, top-2, experts; the loss is the mean square of the output."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(8, 4)
        self.experts = Experts()

    def forward(self, x):
        weights = self.router(x).softmax(-1)
        top_w, top_i = weights.topk(2, -1)
        return self.experts(x, top_i, top_w).square().mean()


def moe_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(6, 8, generator=torch.Generator().manual_seed(seed))}


class SegmentPool(nn.Module):
    """Mean of each segment of `x`, lengths read from `sizes` (data-dependent: an opaque leaf)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 6)

    def forward(self, x, sizes):
        h = torch.tanh(self.proj(x))
        pooled, start = [], 0
        for n in sizes.tolist():
            pooled.append(h[start : start + n].mean(0))
            start += n
        return torch.stack(pooled)


class LeafNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(3, 4)
        self.pool = SegmentPool()
        self.head = nn.Linear(6, 2)

    def forward(self, x, sizes, y):
        return ((self.head(self.pool(self.embed(x), sizes)) - y) ** 2).mean()


def leaf_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(7, 3, generator=g),
        "sizes": torch.tensor([3, 4]),
        "y": torch.randn(2, 2, generator=g),
    }


def loss_of(model: nn.Module, batch: dict[str, Any]) -> float:
    with torch.no_grad():
        return float(model(**batch))


def scramble(params: list[nn.Parameter], seed: int = 7) -> None:
    """Overwrite `params` in place with other values (the copy's weights change, its objects do not)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))


def check_independent_copy(
    original: nn.Module,
    make_copy: Callable[[nn.Module], nn.Module],
    batch: dict[str, Any],
    pick: Callable[[nn.Module], list[nn.Parameter]],
) -> nn.Module:
    """The copy computes what the original does; changing the copy's `pick`ed weights changes its output
    and not the original's; the copy's backward gives gradients to its parameters only."""
    before = loss_of(original, batch)
    dup = make_copy(original)
    assert loss_of(dup, batch) == before, "a fresh copy computes what the original does"
    ids = {id(p) for p in original.parameters()}
    assert not ids & {id(p) for p in dup.parameters()}, "the copy holds the original's parameters"
    scramble(pick(dup))
    assert loss_of(dup, batch) != before, "changing the copy's weights left its output unchanged"
    assert loss_of(original, batch) == before, "changing the copy's weights changed the original's output"
    original.zero_grad(set_to_none=True)
    dup.zero_grad(set_to_none=True)
    dup(**batch).backward()
    assert all(p.grad is None for p in original.parameters()), "the copy's gradients landed on the original"
    assert all(p.grad is not None for p in pick(dup)), "the copy's own weights got no gradient"
    return dup


def deepcopy(module: nn.Module) -> nn.Module:
    return copy.deepcopy(module)
