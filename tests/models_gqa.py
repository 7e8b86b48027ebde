"""A small decoder written for the GQA tests: attention through SDPA's `enable_gqa` (8 query heads
reading 2 key/value heads), not through a model library."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HEADS, KV_HEADS, SEQ = 48, 32, 8, 2, 12


class GroupedAttentionLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.head_dim = DIM // HEADS
        self.q = nn.Linear(DIM, DIM, bias=False)
        self.kv = nn.Linear(DIM, 2 * KV_HEADS * self.head_dim, bias=False)
        self.o = nn.Linear(DIM, DIM, bias=False)
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        b, s = idx.shape
        x = self.embed(idx)
        q = self.q(x).view(b, s, HEADS, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, KV_HEADS, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, DIM))
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


def _make_batch(seed: int, batch_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return {"idx": tokens[:, :-1].clone(), "targets": tokens[:, 1:].clone()}


def build(seed: int = 0):
    torch.manual_seed(seed)
    return GroupedAttentionLM().train(), _make_batch
