"""Models whose layers cost very different amounts, written for the pipeline-balance tests.

- `build_unequal`: an embedding, then a list of unequal layers (state-space: a depthwise causal
  conv1d and a gated linear recurrence written with torch ops; attention with
  F.scaled_dot_product_attention; a mixture of experts with hand-written top-2 routing over dense
  experts), then a head with the loss.
- `build_gnn`: a graph network: node and edge counts from an edge list, message passing with
  index_select and index_add over the edges, a readout and a loss; `build_gnn_flat` the same with
  its rounds as plain attributes (no ModuleList) and more index arithmetic up front.

Both are small (a few thousand parameters) and deterministic from their seed.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "UnequalStack",
    "GraphNet",
    "FlatGraphNet",
    "build_unequal",
    "build_gnn",
    "build_gnn_flat",
    "UNEQUAL_LAYERS",
]

VOCAB, HIDDEN, SEQ = 48, 16, 8

UNEQUAL_LAYERS = ("ssm", "attn", "moe", "attn", "ssm", "moe", "attn", "ssm")
"""The layer kinds of the stack, in order."""


class StateSpace(nn.Module):
    """Mamba-like: in-projection to x and gate z, a depthwise causal conv over the sequence, a gated
    linear recurrence h_t = a_t h_{t-1} + (1 - a_t) x_t, the gate, an out-projection."""

    def __init__(self, hidden: int = HIDDEN, inner: int = 2 * HIDDEN, kernel: int = 3) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.in_proj = nn.Linear(hidden, 2 * inner, bias=False)
        self.conv = nn.Conv1d(inner, inner, kernel, groups=inner, padding=kernel - 1)
        self.decay = nn.Linear(inner, inner)
        self.out_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        seq = h.shape[1]
        x, z = self.in_proj(self.norm(h)).chunk(2, dim=-1)
        x = self.conv(x.transpose(1, 2))[..., :seq].transpose(1, 2)
        x = F.silu(x)
        a = torch.sigmoid(self.decay(x))
        state = torch.zeros_like(x[:, 0])
        outs = []
        for t in range(seq):
            state = a[:, t] * state + (1 - a[:, t]) * x[:, t]
            outs.append(state)
        y = torch.stack(outs, dim=1) * F.silu(z)
        return h + self.out_proj(y)


class Attention(nn.Module):
    """Pre-norm causal self-attention (fused q/k/v, scaled_dot_product_attention) and a small MLP."""

    def __init__(self, hidden: int = HIDDEN, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.norm2 = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.o_proj(att.transpose(1, 2).reshape(b, s, d))
        return h + self.down(F.gelu(self.up(self.norm2(h))))


class Expert(nn.Module):
    def __init__(self, hidden: int = HIDDEN, inner: int = 3 * HIDDEN) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class MixtureOfExperts(nn.Module):
    """Top-2 routing written by hand over dense experts: every expert runs on every token and its output
    is weighted by the token's (renormalised) top-2 router probabilities, zero for the others."""

    def __init__(self, hidden: int = HIDDEN, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm = nn.LayerNorm(hidden)
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden) for _ in range(experts))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm(h)
        probs = torch.softmax(self.router(x), dim=-1)
        kth = torch.topk(probs, self.top_k, dim=-1).values[..., -1:]
        gates = probs * (probs >= kth).to(probs.dtype)
        gates = gates / gates.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + gates[..., e : e + 1] * expert(x)
        return h + out


_KINDS = {"ssm": StateSpace, "attn": Attention, "moe": MixtureOfExperts}


class UnequalStack(nn.Module):
    """Embedding, layers of very different cost (UNEQUAL_LAYERS), a head; forward returns the LM loss."""

    def __init__(self, kinds: tuple[str, ...] = UNEQUAL_LAYERS) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(_KINDS[k]() for k in kinds)
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def build_unequal(seed: int = 0):
    torch.manual_seed(seed)
    model = UnequalStack()

    def make_batch(seed: int, batch_size: int) -> dict:
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
        return {"input_ids": tokens[:, :-1].clone(), "labels": tokens[:, 1:].clone()}

    return model.train(), make_batch


NODES, EDGES, FEATURES = 12, 40, 8


class MessagePassing(nn.Module):
    """One round: messages from each edge's source node, summed at its destination (index_add),
    averaged by in-degree, then a node update with a residual."""

    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.message = nn.Linear(hidden, hidden)
        self.update = nn.Linear(2 * hidden, hidden)

    def forward(self, x, src, dst, inv_degree):
        msg = F.relu(self.message(x.index_select(0, src)))
        agg = torch.zeros_like(x).index_add(0, dst, msg) * inv_degree
        return x + F.relu(self.update(torch.cat([x, agg], dim=-1)))


class GraphNet(nn.Module):
    """Node regression on a graph given as node features and an edge list (batch = stacked graphs with
    their edges offset, as PyG batches them)."""

    def __init__(self, rounds: int = 3) -> None:
        super().__init__()
        self.encode = nn.Linear(FEATURES, HIDDEN)
        self.layers = nn.ModuleList(MessagePassing() for _ in range(rounds))
        self.readout = nn.Linear(HIDDEN, 1)

    def forward(self, x, edges, y):
        src, dst = edges[0], edges[1]
        ones = torch.ones_like(dst, dtype=x.dtype)
        degree = torch.zeros(x.shape[0], dtype=x.dtype).index_add(0, dst, ones)
        inv_degree = (1.0 / degree.clamp(min=1.0)).unsqueeze(-1)
        h = F.relu(self.encode(x))
        for layer in self.layers:
            h = layer(h, src, dst, inv_degree)
        return F.mse_loss(self.readout(h).squeeze(-1), y)


class FlatGraphNet(GraphNet):
    """GraphNet with its rounds as attributes (`round1`, `round2`), no list: nothing repeats in a
    ModuleList, so nnScaler 0.8's even split of the operators would apply."""

    def __init__(self) -> None:
        super().__init__(rounds=0)
        self.round1 = MessagePassing()
        self.round2 = MessagePassing()

    def forward(self, x, edges, y):
        src, dst = edges[0], edges[1]
        ones = torch.ones_like(dst, dtype=x.dtype)
        degree = torch.zeros(x.shape[0], dtype=x.dtype).index_add(0, dst, ones)
        inv_degree = (1.0 / degree.clamp(min=1.0)).unsqueeze(-1)
        scale = torch.sqrt(inv_degree) * inv_degree.mean()
        inv_degree = (inv_degree * scale).clamp(max=1.0)
        h = F.relu(self.encode(x))
        h = self.round2(self.round1(h, src, dst, inv_degree), src, dst, inv_degree)
        return F.mse_loss(self.readout(h).squeeze(-1), y)


def build_gnn_flat(seed: int = 0):
    model, make_batch = build_gnn(seed)
    torch.manual_seed(seed)
    return FlatGraphNet().train(), make_batch


def build_gnn(seed: int = 0):
    torch.manual_seed(seed)
    model = GraphNet()

    def make_batch(seed: int, batch_size: int) -> dict:
        g = torch.Generator().manual_seed(seed)
        xs, edges, ys = [], [], []
        for k in range(batch_size):
            xs.append(torch.randn(NODES, FEATURES, generator=g))
            edges.append(torch.randint(0, NODES, (2, EDGES), generator=g) + k * NODES)
            ys.append(torch.randn(NODES, generator=g))
        return {"x": torch.cat(xs), "edges": torch.cat(edges, dim=1), "y": torch.cat(ys)}

    return model.train(), make_batch
