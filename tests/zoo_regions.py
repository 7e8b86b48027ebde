"""A tiny vision-language model whose top module reads split sizes from a tensor (opaque method region).

    model, make_batch = build_vlm(seed=0)        # "tests.zoo_regions:build_vlm" for the harness
    loss = model(**make_batch(seed=1, batch_size=4))

Each sequence holds one image of `grid[b] = (t, h, w)` patches. The vision encoder maps every patch to
a feature; the top module's `merge_images` splits the features per image by `grid.prod(-1).tolist()`
(sizes read from a tensor: torch.export cannot trace it), projects them and writes each image's
features over its sequence's image tokens (positions 1 .. n). Only that method runs as an opaque op:
the vision encoder and the text decoder (self-attention via F.scaled_dot_product_attention) are traced
and split. Written for the tests (not a zoo family).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["VisionLanguageModel", "build_vlm"]

_VOCAB, _DIM, _HEADS, _LAYERS, _SEQ, _PATCH = 32, 16, 2, 3, 12, 12
_GRIDS = ((1, 2, 2), (1, 2, 3), (1, 1, 3), (2, 1, 2))  # 4, 6, 3, 4 patches


class VisionEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch = nn.Linear(_PATCH, _DIM)
        self.fc1 = nn.Linear(_DIM, 2 * _DIM)
        self.fc2 = nn.Linear(2 * _DIM, _DIM)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        h = self.patch(pixels)
        return h + self.fc2(F.gelu(self.fc1(h)))


class DecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(_DIM), nn.LayerNorm(_DIM)
        self.qkv = nn.Linear(_DIM, 3 * _DIM)
        self.out = nn.Linear(_DIM, _DIM)
        self.up = nn.Linear(_DIM, 2 * _DIM)
        self.down = nn.Linear(2 * _DIM, _DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, _HEADS, -1).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, _DIM))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class VisionLanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.vision = VisionEncoder()
        self.projector = nn.Linear(_DIM, _DIM)
        self.image_gate = nn.Parameter(torch.ones(_DIM))
        self.embed = nn.Embedding(_VOCAB, _DIM)
        self.layers = nn.ModuleList(DecoderLayer() for _ in range(_LAYERS))
        self.norm = nn.LayerNorm(_DIM)
        self.head = nn.Linear(_DIM, _VOCAB, bias=False)

    def merge_images(self, embeds: torch.Tensor, feats: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """Each image's features over its sequence's image tokens (positions 1 .. n)."""
        sizes = grid.prod(-1).tolist()
        pieces = torch.split(self.projector(feats) * self.image_gate, sizes)
        rows = [torch.cat([embeds[b, :1], p, embeds[b, 1 + p.shape[0] :]]) for b, p in enumerate(pieces)]
        return torch.stack(rows)

    def forward(self, input_ids, pixel_values, image_grid_thw, labels):
        x = self.merge_images(self.embed(input_ids), self.vision(pixel_values), image_grid_thw)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def build_vlm(seed: int = 0) -> tuple[nn.Module, Any]:
    """The model (about 9k parameters) and `make_batch(seed, batch_size)`: one image per sequence."""
    torch.manual_seed(seed)
    model = VisionLanguageModel()

    def make_batch(seed: int, batch_size: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        # images of every size, in a random order: each sequence's differs, the batch's total does not
        # (a pipeline's micro-batches must have the same shapes)
        picks = [i % len(_GRIDS) for i in torch.randperm(batch_size, generator=g).tolist()]
        grid = torch.tensor([_GRIDS[i] for i in picks])
        ids = torch.randint(0, _VOCAB, (batch_size, _SEQ), generator=g)
        pixels = torch.randn(int(grid.prod(-1).sum()), _PATCH, generator=g)
        return {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": grid, "labels": ids.roll(-1, 1)}

    return model, make_batch
