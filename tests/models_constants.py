"""Test models whose forward uses constant tensors (lifted by torch.export as CONSTANT_TENSOR) that
pipeline stages use unevenly, with buffers used by one stage only and an embedding tied to the output
head across stages.

Built by name through `tests.zoo.build("tests.models_constants:build")` (spawned ranks import them).
With 4 blocks and 2 pipeline stages, stage 0 runs blocks 0-1 and stage 1 runs blocks 2-3. `build`:
- block 0 multiplies by `torch.tensor([...])` made in its forward (a constant of stage 0 only);
- block 3 adds `torch.tensor([...])` made in its forward (a constant of stage 1 only);
- blocks 1 and 2 multiply by `ConstantsLM.mix`, a plain tensor attribute (neither parameter nor
  buffer: a constant that both stages read);
- block 2 holds a persistent buffer and a non-persistent one (stage 1 only);
- the token embedding is the output head too (tied across the stages).
`build_late` keeps only block 3's constant (stage 0 has none: how T5 and Whisper are built) and
`build_early` only block 0's (stage 1 has none). The forward returns the cross-entropy loss.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["ConstantsLM", "build", "build_late", "build_early", "VOCAB", "DIM", "SEQ"]

VOCAB, DIM, SEQ = 32, 8, 6


class Block(nn.Module):
    """A residual MLP block; `kind` picks the constant or buffers it uses besides its weights."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.norm = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, DIM)
        if kind == "buffers":
            self.register_buffer("offset", torch.linspace(-0.5, 0.5, DIM))
            self.register_buffer("gain", torch.linspace(0.5, 1.5, DIM), persistent=False)

    def forward(self, x: torch.Tensor, mix: torch.Tensor | None) -> torch.Tensor:
        h = self.fc(self.norm(x))
        if self.kind == "scale":
            h = h * torch.tensor([1.0, 0.5, 2.0, 1.5, 0.25, 1.0, 0.75, 1.25])
        elif self.kind == "shift":
            h = h + torch.tensor([0.1, -0.1, 0.2, -0.2, 0.3, -0.3, 0.4, -0.4])
        elif self.kind == "buffers":
            h = h * self.gain + self.offset
        if mix is not None and self.kind in ("mix", "buffers"):
            h = h * mix
        return x + F.gelu(h)


class ConstantsLM(nn.Module):
    """Embedding, 4 blocks of the given kinds, final norm, head tied to the embedding."""

    def __init__(self, kinds: tuple[str, ...] = ("scale", "mix", "buffers", "shift"), mix: bool = True):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(k) for k in kinds)
        self.norm = nn.LayerNorm(DIM)
        self.mix = torch.tensor([0.9, 1.1, 1.0, 0.8, 1.2, 1.0, 0.95, 1.05]) if mix else None

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, self.mix)
        logits = self.norm(x) @ self.embed.weight.t()
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _build(seed: int, model_fn) -> tuple[nn.Module, object]:
    torch.manual_seed(seed)
    model = model_fn()

    def make_batch(seed: int, batch_size: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
        return {"idx": tokens[:, :-1].clone(), "targets": tokens[:, 1:].clone()}

    return model.train(), make_batch


def build(seed: int = 0):
    """Constants of stage 0 only, of stage 1 only and of both; buffers of stage 1; a tied head."""
    return _build(seed, ConstantsLM)


def build_late(seed: int = 0):
    """One constant, of the last stage only (stage 0 uses none)."""
    return _build(seed, lambda: ConstantsLM(("plain", "plain", "buffers", "shift"), mix=False))


def build_early(seed: int = 0):
    """One constant, of the first stage only (stage 1 uses none)."""
    return _build(seed, lambda: ConstantsLM(("scale", "plain", "plain", "plain"), mix=False))
