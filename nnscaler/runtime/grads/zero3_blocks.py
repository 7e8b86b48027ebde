"""ZeRO stage 3's bookkeeping pieces (see zero3.py): which block a parameter belongs to, the flat
buffers of a block, the tokens that stand for saved tensors viewing a gathered buffer, and the
autograd Function that hands out a gathered parameter and takes its gradient."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from nnscaler.runtime.grads.buckets import Bucket

__all__ = ["block_of", "Flat", "Block", "Saved", "Unshard", "FlatOwner"]


class FlatOwner(Protocol):
    """What the pieces here call back on the reducer that owns a flat buffer (zero3.Zero3Reducer)."""

    def _done_with(self, flat: Flat) -> None: ...

    def _take(self, flat: Flat, i: int, grad: torch.Tensor) -> None: ...


def block_of(original_name: str) -> str:
    """The block a parameter is gathered with: its module path up to and including the first layer
    index (`transformer.h.0.attn.c_attn.weight` -> `transformer.h.0`), else the first two names of
    the path (`transformer.wte.weight` -> `transformer.wte`; a top-level parameter -> "")."""
    parts = original_name.split(".")[:-1]
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:2])


class Flat:
    """Parameters of one block with one dtype, device and requires_grad, back to back."""

    def __init__(self, block: Block, names: list[str], params: list[nn.Parameter], nshards: int, index: int):
        self.block = block
        self.names = names
        self.params = params
        self.shapes = [tuple(p.shape) for p in params]
        self.offsets: list[int] = []
        numel = 0
        for p in params:
            self.offsets.append(numel)
            numel += p.numel()
        self.numel = numel
        self.size = -(-numel // nshards) * nshards
        shard = self.size // nshards
        self.lo, self.hi = index * shard, (index + 1) * shard
        self.dtype, self.device = params[0].dtype, params[0].device
        self.requires_grad = params[0].requires_grad
        with torch.no_grad():
            full = torch.zeros(self.size, dtype=self.dtype, device=self.device)
            for o, p in zip(self.offsets, params):
                full[o : o + p.numel()].copy_(p.detach().reshape(-1))
            self.shard = full[self.lo : self.hi].clone()
        self.full: torch.Tensor | None = None
        """The gathered buffer while the block is gathered (or being gathered: `work`)."""
        self.work: Any = None
        self.bucket: Bucket | None = None
        self.tokens = 0
        """Saved-tensor tokens (`Saved`) of this buffer alive."""
        self.owner: FlatOwner | None = None
        self.uses = [0] * len(params)
        """Per parameter: times forward handed it out since backward last delivered all its gradients."""

    def view(self, i: int) -> torch.Tensor:
        assert self.full is not None
        o = self.offsets[i]
        return self.full[o : o + self.params[i].numel()].view(self.shapes[i])

    def write(self, i: int, value: torch.Tensor) -> None:
        """Copy this rank's part of parameter `i` (full local tensor `value`) into the shard."""
        o, n = self.offsets[i], self.params[i].numel()
        start, end = max(o, self.lo), min(o + n, self.hi)
        if start < end:
            flat = value.detach().reshape(-1)
            self.shard[start - self.lo : end - self.lo].copy_(flat[start - o : end - o])


class Block:
    """The flat buffers gathered together (one block of the model)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.flats: list[Flat] = []

    @property
    def gathered(self) -> bool:
        return any(f.full is not None for f in self.flats)


class Saved:
    """What a tensor saved for backward becomes when it views a gathered buffer: how to view it again.

    The flat buffer counts its tokens alive: when the last one goes (backward ran every node that
    saved one), backward needs the gathered buffer no more and it is dropped."""

    __slots__ = ("flat", "size", "stride", "offset")

    def __init__(self, flat: Flat, t: torch.Tensor) -> None:
        self.flat, self.size, self.stride, self.offset = flat, t.size(), t.stride(), t.storage_offset()
        flat.tokens += 1

    def __del__(self) -> None:
        flat = self.flat
        flat.tokens -= 1
        if flat.tokens == 0 and flat.owner is not None:
            flat.owner._done_with(flat)  # waits at most for this buffer's own gather


class Unshard(torch.autograd.Function):
    """A gathered parameter: forward is the view of the gathered buffer; backward adds the gradient
    to the parameter's place in its flat buffer's gradient bucket (`Zero3Reducer._take`); the registered
    parameter gets no `.grad`."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, owner: FlatOwner, flat: Flat, i: int) -> torch.Tensor:
        ctx.where = (owner, flat, i)
        return flat.view(i)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        owner, flat, i = ctx.where
        owner._take(flat, i, grad)
        return None, None, None, None
