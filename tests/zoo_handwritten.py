"""A hand-written MLP stack for the op-rule tests of issue 40 (tests/test_handwritten_ops_parity.py).

`build_einsum_gelu`: token embedding, then LAYERS residual blocks, each an RMS norm written as a custom
`torch.autograd.Function` (`RmsNorm`, row-wise, with a weight), an up projection
written as `torch.einsum("bsd,fd->bsf", x, w)` plus a bias, a GeLU written as a custom
`torch.autograd.Function` (`TanhGelu`, module level so generated code can import it, with its own
hand-written backward), and a down projection `torch.einsum("bsf,df->bsd", h, w)`; then a norm and a
linear head with cross entropy. `build_einsum_heads`: the same with projections by heads written as
einsum ("bsd,hde->bhse", then "bhse,hed->bsd"). Tiny (a few thousand parameters), fp32, train mode;
`make_batch(seed, batch_size)` gives token ids and labels of length SEQ.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TanhGelu", "RmsNorm", "build_einsum_gelu", "build_einsum_heads", "SEQ"]

SEQ = 8
VOCAB = 16
WIDTH = 16
HIDDEN = 48
LAYERS = 2
_C = 0.7978845608028654  # sqrt(2 / pi)


class TanhGelu(torch.autograd.Function):
    """GeLU, tanh approximation, forward and backward by hand (elementwise: no annotation given)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return 0.5 * x * (1.0 + torch.tanh(_C * (x + 0.044715 * x.pow(3))))

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        t = torch.tanh(_C * (x + 0.044715 * x.pow(3)))
        dt = (1.0 - t * t) * _C * (1.0 + 3 * 0.044715 * x * x)
        return grad * (0.5 * (1.0 + t) + 0.5 * x * dt)


class RmsNorm(torch.autograd.Function):
    """RMS norm with a weight, forward and backward by hand (row-wise: each row on its own)."""

    @staticmethod
    def forward(ctx, x, weight):
        inv = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        ctx.save_for_backward(x, weight, inv)
        return x * inv * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight, inv = ctx.saved_tensors
        normed = x * inv
        gw = (grad * normed).flatten(0, -2).sum(0)
        gn = grad * weight
        gx = inv * (gn - normed * (gn * normed).mean(-1, keepdim=True))
        return gx, gw


class EinsumMlp(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.norm_weight = nn.Parameter(torch.ones(width) + 0.1 * torch.randn(width))
        self.w_up = nn.Parameter(torch.randn(hidden, width) / width**0.5)
        self.b_up = nn.Parameter(torch.zeros(hidden))
        self.w_down = nn.Parameter(torch.randn(width, hidden) / hidden**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.einsum("bsd,fd->bsf", RmsNorm.apply(x, self.norm_weight), self.w_up) + self.b_up
        return x + torch.einsum("bsf,df->bsd", TanhGelu.apply(h), self.w_down)


class EinsumGeluNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(EinsumMlp(WIDTH, HIDDEN) for _ in range(LAYERS))
        self.norm = nn.RMSNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class HeadsMlp(nn.Module):
    """Projections by heads written with einsum: "bsd,hde->bhse" in, "bhse,hed->bsd" out."""

    def __init__(self, width: int, heads: int, head_dim: int):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(heads, width, head_dim) / width**0.5)
        self.w_out = nn.Parameter(torch.randn(heads, head_dim, width) / (heads * head_dim) ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = TanhGelu.apply(torch.einsum("bsd,hde->bhse", x, self.w_in))
        return x + torch.einsum("bhse,hed->bsd", h, self.w_out)


class EinsumHeadsNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(HeadsMlp(WIDTH, 4, 8) for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _tokens(seed: int, batch_size: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return {"input_ids": tokens[:, :-1].clone(), "labels": tokens[:, 1:].clone()}


def build_einsum_gelu(seed: int = 0):
    torch.manual_seed(seed)
    return EinsumGeluNet().train(), _tokens


def build_einsum_heads(seed: int = 0):
    torch.manual_seed(seed)
    return EinsumHeadsNet().train(), _tokens
