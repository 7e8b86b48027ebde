"""A tiny model made of the ops that functional capture and state-space / latent-attention models
bring: writes into slices (slice_scatter, select_scatter, copy), scatter, index_put, an unequal
torch.split and a depthwise conv1d. Reached by the parity harness as
`"tests.models_writes:build_writes"`."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.zoo import MakeBatch, _generator

__all__ = ["Writes", "build_writes"]

VOCAB, SEQ = 32, 8


class Writes(nn.Module):
    def __init__(self, d: int = 16, e: int = 24, r: int = 4, s: int = 6, k: int = 4):
        super().__init__()
        self.e, self.r, self.s = e, r, s
        self.emb = nn.Embedding(VOCAB, d)
        self.in_proj = nn.Linear(d, 2 * e)
        self.conv = nn.Conv1d(e, e, k, groups=e, padding=k - 1)  # depthwise, as Mamba's
        self.x_proj = nn.Linear(e, r + 2 * s, bias=False)
        self.dt_proj = nn.Linear(r, e)
        self.out_proj = nn.Linear(e, d, bias=False)
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        x, z = self.in_proj(self.emb(input_ids)).chunk(2, dim=-1)
        x = F.silu(self.conv(x.transpose(1, 2))[..., :length].transpose(1, 2))
        dt, b, c = torch.split(self.x_proj(x), [self.r, self.s, self.s], dim=-1)  # unequal pieces
        y = x * F.silu(z) + self.dt_proj(dt) * (b * c).sum(-1, keepdim=True)
        out = torch.zeros_like(y)
        out[..., : self.e // 2] = y[..., : self.e // 2] * 2  # slice_scatter
        out[..., self.e // 2 :] = y[..., self.e // 2 :]
        out[:, 0] = y[:, 0] - 1  # select_scatter
        idx = (input_ids % self.e).unsqueeze(-1)
        out = out.scatter_add(-1, idx, torch.tanh(y[..., :1]))
        rows = torch.arange(2, device=out.device)
        out[:, rows] = out[:, rows] * 0.5  # index_put
        return F.cross_entropy(self.head(self.out_proj(out)).flatten(0, 1), labels.flatten())


def build_writes(seed: int = 0) -> tuple[nn.Module, MakeBatch]:
    torch.manual_seed(seed)
    model = Writes()

    def make_batch(seed: int, batch_size: int) -> dict[str, Any]:
        ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=_generator(seed))
        return {"input_ids": ids[:, :-1].clone(), "labels": ids[:, 1:].clone()}

    return model, make_batch


def pas_last(graph, cfg):
    """A policy that splits every op on the last identifier its rule allows (channels, features,
    sequence rather than the batch), so that the rules' less common splits run end to end."""
    from nnscaler.graph.ops import annotate_node, split_candidates
    from nnscaler.policies import NodePlan, Plan

    nodes = {}
    for node in graph.nodes:
        bound = annotate_node(node, graph)
        candidates = split_candidates(bound, cfg.plan_ngpus) if bound is not None else []
        nodes[node.name] = NodePlan(candidates[-1], cfg.plan_ngpus) if candidates else NodePlan()
    return Plan("last", cfg.plan_ngpus, nodes)
