"""A small conv net for conv tensor-parallel tests (fresh, not the zoo): conv+bias -> GroupNorm -> SiLU
-> conv+bias -> average pool -> linear head -> cross entropy, about 3,000 parameters.

Under tp the first conv is column-parallel (output channels split, flowing through the group norm's
whole groups and the SiLU) and the second row-parallel: its input channels split, the local conv runs
without its bias, the partial sums are all-reduced, then the bias is added once.
`build_conv_net(seed)` returns (model, make_batch); `make_batch(seed, batch_size)` gives images and
class labels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CHANNELS, WIDTH, CLASSES, SIZE = 3, 16, 10, 8


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(CHANNELS, WIDTH, 3, padding=1)
        self.norm = nn.GroupNorm(4, WIDTH)
        self.conv2 = nn.Conv2d(WIDTH, WIDTH, 3, stride=2, padding=1)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = F.silu(self.norm(self.conv1(images)))
        x = self.conv2(x).mean(dim=(2, 3))
        return F.cross_entropy(self.head(x), labels)


def _images(seed: int, batch_size: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(batch_size, CHANNELS, SIZE, SIZE, generator=g)
    return {"images": images, "labels": torch.randint(0, CLASSES, (batch_size,), generator=g)}


def build_conv_net(seed: int = 0):
    torch.manual_seed(seed)
    return ConvNet().train(), _images
