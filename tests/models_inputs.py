"""Test models for real inputs (issue 9): aliased dummy inputs, tensors made in forward.

Built by name through `tests.zoo.build("tests.models_inputs:build_alibi")`, so spawned parity ranks
can import them. `make_batch(seed, batch_size)` follows the zoo's contract; the parity harness traces
with `make_batch(parity.DUMMY_SEED, ...)`.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests import zoo

__all__ = ["AlibiLM", "XYBlocks", "build_alibi", "build_llama_aliased", "build_xy_blocks", "DUMMY_SEED"]

DUMMY_SEED = 12345
"""tests.parity.DUMMY_SEED (kept equal; imported there would be circular)."""
VOCAB, DIM, HEADS, SEQ = 64, 32, 4, 12


class AlibiAttention(nn.Module):
    """Causal self-attention with ALiBi biases whose per-head slopes are made in forward from a list
    (as BLOOM and MPT do), and a per-head scale made with torch.tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        slopes = torch.tensor(
            [2.0 ** (-8.0 * (h + 1) / HEADS) for h in range(HEADS)]
        )  # a forward-made constant
        pos = torch.arange(t, device=x.device)
        distance = (pos[None, :] - pos[:, None]).clamp(max=0).float()  # [t, t], <= 0 below the diagonal
        bias = slopes.view(1, HEADS, 1, 1) * distance  # [1, heads, t, t]
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        bias = bias.masked_fill(~causal, float("-inf"))
        scores = q @ k.transpose(-1, -2) / math.sqrt(c // HEADS) + bias
        y = F.softmax(scores, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class AlibiLM(nn.Module):
    """Embedding, two ALiBi attention + MLP blocks, untied head; returns the mean cross entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"ln": nn.LayerNorm(DIM), "attn": AlibiAttention()}) for _ in range(2)
        )
        self.mlps = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM)) for _ in range(2)
        )
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block, mlp in zip(self.blocks, self.mlps):
            x = x + block["attn"](block["ln"](x))
            x = x + mlp(x)
        logits = self.head(self.norm(x))
        weights = torch.tensor([1.0, 1.0])  # another constant, unrelated to any weight
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()) * weights.mean()


def _token_batch(vocab: int, seq: int, input_key: str, label_key: str):
    def make_batch(seed: int, batch_size: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (batch_size, seq), generator=g)
        if seed == DUMMY_SEED:  # as Hugging Face examples build it: one tensor for both arguments
            return {input_key: ids, label_key: ids}
        return {input_key: ids, label_key: torch.randint(0, vocab, (batch_size, seq), generator=g)}

    return make_batch


def build_alibi(seed: int = 0):
    torch.manual_seed(seed)
    return AlibiLM().train(), _token_batch(VOCAB, SEQ, "idx", "targets")


def build_llama_aliased(seed: int = 0):
    """The zoo's tiny Llama, traced with `{"input_ids": ids, "labels": ids}` (one tensor), trained on
    labels that differ from the inputs."""
    model, make_batch = zoo.build("llama", seed)
    return model, _token_batch(model.config.vocab_size, 16, "input_ids", "labels")


class XYBlocks(nn.Module):
    """forward(x, y): inputs named like the generated code's own locals; repeated blocks (pipelines)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, DIM), nn.GELU()) for _ in range(4)
        )
        self.out = nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return F.mse_loss(self.out(x), y)


def build_xy_blocks(seed: int = 0):
    torch.manual_seed(seed)

    def make_batch(seed: int, batch_size: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return {
            "x": torch.randn(batch_size, SEQ, DIM, generator=g),
            "y": torch.randn(batch_size, SEQ, 4, generator=g),
        }

    return XYBlocks().train(), make_batch
