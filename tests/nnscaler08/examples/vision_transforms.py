"""Compose, Resize, ToTensor and Normalize with torchvision's meaning, for PIL images: what vit_cli.py
imports from torchvision, whose build for the installed torch cannot load here (PyPI's wheels are
CUDA builds; the CPU ones live on another index). adapt.py points vit_cli's import here only when
`import torchvision.transforms` fails; not on the path otherwise (transformers probes torchvision)."""

from __future__ import annotations

import numpy as np
import torch


class Compose:
    def __init__(self, transforms):
        self.transforms = list(transforms)

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


class Resize:
    """The shorter side to `size` (an int) or the image to (h, w), bilinear."""

    def __init__(self, size):
        self.size = size

    def __call__(self, img):
        w, h = img.size
        if isinstance(self.size, int):
            s = self.size
            size = (s, round(w * s / h)) if h <= w else (round(h * s / w), s)
        else:
            size = tuple(self.size)
        return img.resize((size[1], size[0]), resample=2)  # PIL.Image.BILINEAR


class ToTensor:
    """A PIL image as a float tensor (C, H, W) in [0, 1]."""

    def __call__(self, img):
        arr = np.asarray(img, dtype=np.float32) / 255.0
        if arr.ndim == 2:
            arr = arr[:, :, None]
        return torch.from_numpy(arr.transpose(2, 0, 1).copy())


class Normalize:
    def __init__(self, mean, std):
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, x):
        return (x - self.mean) / self.std
