"""Test models whose token embedding is reused, transposed, as the output head (issue 9).

Built by name through `tests.zoo.build("tests.models_tied:build_matmul")`, so spawned parity ranks
can import them. The forward returns the cross-entropy loss (a scalar) first.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "TiedHeadLM",
    "build_matmul",
    "build_einsum",
    "build_embedding",
    "build_t",
    "hybrid_row_parallel_head",
    "tp_row_parallel_head",
]

VOCAB, DIM, SEQ = 64, 32, 8


class Block(nn.Module):
    """Pre-norm MLP block with a residual (pipeline stages start at these)."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TiedHeadLM(nn.Module):
    """Embedding `tok_weight` [vocab, dim], blocks, final norm, head `x @ tok_weight.T` (or einsum).

    head: "matmul" (`x @ w.T`), "einsum" (`einsum('bsd,vd->bsv')`), "t" (`x @ w.t()`, an annotated
    transpose the `tp` policy can split); `module_embedding` stores the table in an nn.Embedding
    (`embed.weight`) instead of a bare parameter.
    """

    def __init__(self, head: str = "matmul", module_embedding: bool = False, n_layer: int = 4):
        super().__init__()
        self.head, self.module_embedding = head, module_embedding
        if module_embedding:
            self.embed = nn.Embedding(VOCAB, DIM)
        else:
            self.tok_weight = nn.Parameter(torch.randn(VOCAB, DIM) * 0.5)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(n_layer))
        self.norm = nn.LayerNorm(DIM)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        w = self.embed.weight if self.module_embedding else self.tok_weight
        x = self.embed(idx) if self.module_embedding else F.embedding(idx, w)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        if self.head == "einsum":
            logits = torch.einsum("bsd,vd->bsv", x, w)
        elif self.head == "t":
            logits = x @ w.t()
        else:
            logits = x @ w.T
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _make_batch(seed: int, batch_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return {"idx": tokens[:, :-1].clone(), "targets": tokens[:, 1:].clone()}


def _build(seed: int, **kwargs):
    torch.manual_seed(seed)
    return TiedHeadLM(**kwargs).train(), _make_batch


def build_matmul(seed: int = 0):
    """Bare parameter, head `x @ tok_weight.T`."""
    return _build(seed, head="matmul")


def build_einsum(seed: int = 0):
    """Bare parameter, head `einsum('bsd,vd->bsv', x, tok_weight)`."""
    return _build(seed, head="einsum")


def build_embedding(seed: int = 0):
    """nn.Embedding table, head `x @ embed.weight.T`."""
    return _build(seed, head="matmul", module_embedding=True)


def build_t(seed: int = 0):
    """Bare parameter, head `x @ tok_weight.t()` (for the row-parallel head policies below)."""
    return _build(seed, head="t")


def _row_parallel_head(graph, plan):
    """`plan` with the head `x @ w.t()` split on its reduction dim (the weight wanted as S(1), where the
    vocab-parallel embedding wants S(0)) and everything after it kept whole."""
    from nnscaler.policies import REPLICATE, NodePlan

    nodes = dict(plan.nodes)
    order = [n.name for n in graph.nodes]
    t = next(n for n in graph.nodes if n.op == "aten.t.default")
    head = next(n for n in graph.nodes if t.outputs[0] in n.input_names())
    nodes[t.name] = NodePlan("b", plan.tp_size, note="test: weight columns split")
    nodes[head.name] = NodePlan("k", plan.tp_size, note="test: row-parallel head")
    for name in order[order.index(head.name) + 1 :]:
        nodes[name] = REPLICATE
    return dataclasses.replace(plan, nodes=nodes)


def hybrid_row_parallel_head(graph, cfg):
    """The `hybrid` policy, but the last stage's head is row-parallel: tok_weight S(0) / S(1) by stage."""
    from nnscaler.policies.pipeline import pas_hybrid

    return _row_parallel_head(graph, pas_hybrid(graph, cfg))


def tp_row_parallel_head(graph, cfg):
    """The `tp` policy with a row-parallel head: one stage uses tok_weight as S(0) and as S(1)."""
    from nnscaler.policies.tp import pas_tp

    return _row_parallel_head(graph, pas_tp(graph, cfg))
