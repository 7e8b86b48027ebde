"""Models written for the capture time-budget tests (tests/compiler/test_capture_budget.py).

- `build_swin`: a Swin-style vision transformer: per-pixel embedding, blocks of shifted-window
  attention (pad H and W to a multiple of the window, `torch.roll` by half a window on odd blocks,
  window partition and merge by `view`s over `H // window`, attention written by hand with a learned
  relative-position bias gathered from a table), an MLP, mean pooling and a classifier. Inputs are
  7 x 7 images, so the padding is real. A few thousand parameters, fp32, train mode.
- `NestedWindows`: padding to a multiple of several windows in turn, each on the last one's padded
  size, with a window view and a roll each time. With every input dim symbolic, torch.export's sympy
  work grows steeply with the number of windows (2: ~10 s, 4: minutes here); with fixed sizes it
  traces in a fraction of a second. The model for the budget test.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["build_swin", "NestedWindows", "SwinBlock", "images"]

IMAGE = 7
CHANNELS = 3
CLASSES = 5
WIDTH = 16
HEADS = 2
WINDOW = 4


def images(seed: int, batch_size: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "pixels": torch.randn(batch_size, IMAGE, IMAGE, CHANNELS, generator=g),
        "labels": torch.randint(0, CLASSES, (batch_size,), generator=g),
    }


def _relative_index(window: int) -> torch.Tensor:
    """(w*w, w*w): for each query and key position in a window, the row of its relative offset in a
    (2w-1)^2 table (Swin's relative_position_index)."""
    coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
    return rel[..., 0] * (2 * window - 1) + rel[..., 1]


class SwinBlock(nn.Module):
    """Shifted-window self-attention and an MLP, each with a pre-norm and a residual (x: B H W C)."""

    def __init__(self, width: int, heads: int, window: int, shift: int):
        super().__init__()
        self.heads, self.window, self.shift = heads, window, shift
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.bias_table = nn.Parameter(torch.randn((2 * window - 1) ** 2, heads) * 0.02)
        self.register_buffer("bias_index", _relative_index(window), persistent=False)
        self.norm2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        w, heads = self.window, self.heads
        pad_h, pad_w = (w - H % w) % w, (w - W % w) % w
        h = F.pad(x, (0, 0, 0, pad_w, 0, pad_h))
        Hp, Wp = H + pad_h, W + pad_w
        if self.shift:
            h = torch.roll(h, shifts=(-self.shift, -self.shift), dims=(1, 2))
        windows = h.view(B, Hp // w, w, Wp // w, w, C).permute(0, 1, 3, 2, 4, 5).reshape(-1, w * w, C)
        n = windows.shape[0]
        qkv = self.qkv(windows).view(n, w * w, 3, heads, C // heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = (q * (C // heads) ** -0.5) @ k.transpose(-2, -1)
        bias = self.bias_table[self.bias_index.view(-1)].view(w * w, w * w, heads).permute(2, 0, 1)
        scores = scores + bias.unsqueeze(0)
        out = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(n, w * w, C)
        out = self.proj(out)
        out = out.view(B, Hp // w, Wp // w, w, w, C).permute(0, 1, 3, 2, 4, 5).reshape(B, Hp, Wp, C)
        if self.shift:
            out = torch.roll(out, shifts=(self.shift, self.shift), dims=(1, 2))
        return out[:, :H, :W, :]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Swin(nn.Module):
    def __init__(self, depth: int = 2):
        super().__init__()
        self.embed = nn.Linear(CHANNELS, WIDTH)
        self.blocks = nn.ModuleList(
            SwinBlock(WIDTH, HEADS, WINDOW, shift=WINDOW // 2 if i % 2 else 0) for i in range(depth)
        )
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(pixels)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h).mean(dim=(1, 2)))
        return F.cross_entropy(logits, labels)


def build_swin(seed: int = 0):
    torch.manual_seed(seed)
    return Swin().train(), images


class NestedWindows(nn.Module):
    """Pads to a multiple of each window in turn (each on the last padded size): slow for sympy."""

    def __init__(self, windows: tuple[int, ...] = (2, 3, 5, 7)):
        super().__init__()
        self.windows = windows
        self.embed = nn.Linear(CHANNELS, WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(pixels)
        for w in self.windows:
            H, W = h.shape[1], h.shape[2]
            h = F.pad(h, (0, 0, 0, (w - W % w) % w, 0, (w - H % w) % w))
            B, Hp, Wp, C = h.shape
            h = h.view(B, Hp // w, w, Wp // w, w, C).transpose(2, 3).reshape(B, Hp, Wp, C)
            h = torch.roll(h, shifts=(w // 2, w // 2), dims=(1, 2))
        return F.cross_entropy(self.head(h.mean(dim=(1, 2))), labels)


def build_nested(seed: int = 0):
    torch.manual_seed(seed)
    return NestedWindows().train(), images
