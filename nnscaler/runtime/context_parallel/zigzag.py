"""Reorders between the contiguous layout and the (hybrid) zigzag layout: one all-to-all over the
attention's group moves whole fine chunks (S/2N rows) to the ranks that need them, with autograd
(the backward runs the inverse all-to-all on the gradient).

q, k and v travel in one all-to-all (flattened beside the sequence dim and concatenated); the mask
rows in a second one (with autograd where a float mask requires grad); the output back in a third.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from nnscaler.runtime.context_parallel.layout import contiguous_chunks, zigzag_chunks

__all__ = ["redistribute", "to_zigzag", "from_zigzag"]

Chunks = list[list[int]]


def _move(x: torch.Tensor, src: Chunks, dst: Chunks, group: Any) -> torch.Tensor:
    """Rows (dim 0) of `x` held as chunks `src[pos]` -> the rows of chunks `dst[pos]` (no autograd)."""
    n, pos = dist.get_world_size(group), dist.get_rank(group)
    mine = src[pos]
    size = x.shape[0] // len(mine)
    sends = [[c for c in dst[p] if c in mine] for p in range(n)]
    recvs = [[c for c in dst[pos] if c in src[p]] for p in range(n)]
    order = [mine.index(c) for peer in sends for c in peer]
    flat = x.reshape(len(mine), size, *x.shape[1:])[order].reshape(-1, *x.shape[1:])
    wire = flat.view(torch.uint8) if flat.dtype == torch.bool else flat  # gloo has no bool
    out = torch.empty((len(dst[pos]) * size, *x.shape[1:]), dtype=wire.dtype, device=x.device)
    dist.all_to_all_single(
        out, wire.contiguous(), [len(r) * size for r in recvs], [len(s) * size for s in sends], group=group
    )
    arrived = [c for peer in recvs for c in peer]
    back = [arrived.index(c) for c in dst[pos]]
    out = out.view(torch.bool) if x.dtype == torch.bool else out
    return out.reshape(len(arrived), size, *x.shape[1:])[back].reshape(-1, *x.shape[1:])


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, src: Chunks, dst: Chunks, group: Any) -> torch.Tensor:
        ctx.args = (src, dst, group)
        return _move(x, src, dst, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        src, dst, group = ctx.args
        return _move(grad.contiguous(), dst, src, group), None, None, None


def redistribute(x: torch.Tensor, src: Chunks, dst: Chunks, group: Any, dim: int = -2) -> torch.Tensor:
    """Move the chunks of `x` along `dim` from layout `src` to layout `dst` (chunk ids per group
    position, in local order; every chunk the same size), with autograd."""
    moved = x.movedim(dim, 0)
    if x.requires_grad:
        out = _Redistribute.apply(moved, src, dst, group)
    else:
        out = _move(moved, src, dst, group)
    return out.movedim(0, dim)


def _layouts(group: Any, ulysses_size: int) -> tuple[Chunks, Chunks]:
    n = dist.get_world_size(group)
    return contiguous_chunks(n), zigzag_chunks(n, ulysses_size)


def to_zigzag(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    group: Any,
    ulysses_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Contiguous rows (rank r: fine chunks 2r, 2r+1) -> zigzag rows (`layout.zigzag_chunks`)."""
    src, dst = _layouts(group, ulysses_size)
    rows = [t.movedim(-2, 0) for t in (q, k, v)]
    widths = [r[0].numel() for r in rows]
    packed = torch.cat([r.reshape(r.shape[0], -1) for r in rows], dim=1)
    moved = redistribute(packed, src, dst, group, dim=0)
    q, k, v = (part.reshape(r.shape).movedim(0, -2) for part, r in zip(moved.split(widths, dim=1), rows))
    if mask is not None and mask.shape[-2] != 1:
        mask = redistribute(mask, src, dst, group, dim=-2)
    return q, k, v, mask


def from_zigzag(out: torch.Tensor, group: Any, ulysses_size: int = 1) -> torch.Tensor:
    """The inverse of `to_zigzag` for the output rows."""
    src, dst = _layouts(group, ulysses_size)
    return redistribute(out, dst, src, group, dim=-2)
