"""Ulysses (DeepSpeed): all-to-all from sequence-split to head-split, attention on whole
(inner) sequences, all-to-all back. Autograd flows through `comm.all_to_all_in_group`.

Position j of the group gets query heads [j*Hq/U, (j+1)*Hq/U) and the kv heads those read: the
kv heads are split the same way when U divides Hkv, else each kv head is first repeated so that it
does (GQA with fewer kv heads than ranks; the repeats' gradients are summed by autograd).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nnscaler.runtime import comm

__all__ = ["kv_repeats", "scatter_heads", "gather_heads", "gather_mask_rows", "local_attention"]


def kv_repeats(hkv: int, u: int) -> int:
    """How many times to repeat each kv head so that `u` ranks can split them (1: no repeat)."""
    return u // math.gcd(hkv, u)


def _gather_rows(mask: torch.Tensor, group: Any) -> torch.Tensor:
    wire = mask.contiguous().view(torch.uint8) if mask.dtype == torch.bool else mask.contiguous()
    parts = [torch.empty_like(wire) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, wire, group=group)
    full = torch.cat(parts, dim=-2)
    return full.view(torch.bool) if mask.dtype == torch.bool else full


class _GatherRows(torch.autograd.Function):
    """All-gather of an additive bias's rows; backward: every rank's gradient summed, this rank's rows."""

    @staticmethod
    def forward(ctx: Any, mask: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group, ctx.rows = group, mask.shape[-2]
        return _gather_rows(mask, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.narrow(-2, dist.get_rank(ctx.group) * ctx.rows, ctx.rows).contiguous(), None


def gather_mask_rows(mask: torch.Tensor | None, group: Any) -> torch.Tensor | None:
    """All-gather the mask's rows over `group` (rank order = sequence order); a float mask that
    requires grad (an additive bias) gets its rows' gradient back."""
    if mask is None or mask.shape[-2] == 1:
        return mask
    if mask.requires_grad and mask.is_floating_point():
        return _GatherRows.apply(mask, group)
    return _gather_rows(mask, group)


def _mask_heads(mask: torch.Tensor | None, hq: int, group: Any) -> torch.Tensor | None:
    if mask is None or mask.dim() < 3 or mask.shape[-3] == 1:
        return mask
    u, j = dist.get_world_size(group), dist.get_rank(group)
    return mask.narrow(-3, j * (hq // u), hq // u)


def scatter_heads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    group: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Sequence-split (rows of this rank, all heads) -> head-split (all rows of the group, this
    rank's heads). The mask's rows are all-gathered and its heads (if per head) sliced."""
    u = dist.get_world_size(group)
    hq = q.shape[-3]
    reps = kv_repeats(k.shape[-3], u)
    if reps > 1:
        k, v = k.repeat_interleave(reps, dim=-3), v.repeat_interleave(reps, dim=-3)
    q, k, v = (comm.all_to_all_in_group(t, -2, -3, group) for t in (q, k, v))
    return q, k, v, _mask_heads(gather_mask_rows(mask, group), hq, group)


def gather_heads(out: torch.Tensor, group: Any) -> torch.Tensor:
    """The inverse of `scatter_heads` for the output: head-split -> sequence-split."""
    return comm.all_to_all_in_group(out, -3, -2, group)


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """torch's SDPA on whole sequences; a causal mask is folded into a given mask (so the fused
    kernels never see both)."""
    if mask is not None and causal:
        s = q.shape[-2]
        tril = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        mask = mask & tril if mask.dtype == torch.bool else mask.masked_fill(~tril, float("-inf"))
        causal = False
    gqa = q.shape[-3] != k.shape[-3]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
    )
