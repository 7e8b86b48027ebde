"""Gradients across ranks: data-parallel averaging in contiguous buckets, norms and clipping."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "make_buckets",
    "average_gradients",
    "grad_sq_norm",
    "first_holders",
    "scale_grads",
]

DEFAULT_BUCKET_CAP_MB = 25.0
"""Bucket size when `ComputeConfig.reducer_bucket_cap_mb` is None (torch DDP's default)."""


def make_buckets(params: Sequence[torch.Tensor], cap_mb: float | None) -> list[list[torch.Tensor]]:
    """Split `params` (in order) into buckets of one dtype and device, each at most `cap_mb` MB.

    A parameter larger than the cap gets a bucket of its own; `cap_mb == 0` gives one bucket per tensor.
    """
    cap = int((DEFAULT_BUCKET_CAP_MB if cap_mb is None else cap_mb) * 1024 * 1024)
    open_buckets: dict[tuple[torch.dtype, torch.device], tuple[list[torch.Tensor], int]] = {}
    buckets: list[list[torch.Tensor]] = []
    for p in params:
        key = (p.dtype, p.device)
        nbytes = p.numel() * p.element_size()
        bucket, size = open_buckets.get(key, ([], 0))
        if bucket and size + nbytes > cap:
            buckets.append(bucket)
            bucket, size = [], 0
        bucket.append(p)
        open_buckets[key] = (bucket, size + nbytes)
    buckets.extend(b for b, _ in open_buckets.values() if b)
    return buckets


def average_gradients(
    params: Sequence[torch.Tensor], group: dist.ProcessGroup | None, cap_mb: float | None = None
) -> None:
    """Average the gradients of `params` over `group` in place (no-op when `group` is None).

    Parameters without a gradient get zeros first, so every rank sends the same bucket layout.
    All buckets are reduced asynchronously, then waited for.
    """
    if group is None:
        return
    size = dist.get_world_size(group)
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif p.grad.is_sparse:
            raise NotImplementedError("sparse gradients are not supported by the gradient reducer")
    pending = []
    for bucket in make_buckets(params, cap_mb):
        grads = [p.grad for p in bucket]
        flat = _flatten_dense_tensors(grads)
        pending.append((dist.all_reduce(flat, group=group, async_op=True), flat, grads))
    for work, flat, grads in pending:
        work.wait()
        flat.div_(size)
        for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(synced)


def grad_sq_norm(params: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """Sum of squared gradient entries of `params` (fp32 scalar; parameters without grad count 0)."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if p.grad is not None:
            total = total + p.grad.detach().float().pow(2).sum().to(total.device)
    return total


def first_holders(keys: Sequence[Hashable], group: dist.ProcessGroup | None) -> list[bool]:
    """For each of this rank's `keys`: is this rank the lowest in `group` holding the same key?

    Keys name tensor pieces (e.g. original name and shard); used so that a piece replicated on
    several ranks is counted once in a norm. Collective over `group` (all-gather of the keys).
    """
    if group is None:
        return [True] * len(keys)
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, list(keys), group=group)
    owner: dict[Hashable, int] = {}
    for r, rank_keys in enumerate(everyone):
        for k in rank_keys:
            owner.setdefault(k, r)
    me = dist.get_rank(group)
    return [owner[k] == me for k in keys]


def scale_grads(params: Sequence[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale gradients by `min(1, max_norm / (total_norm + 1e-6))`, as `torch.nn.utils.clip_grad_norm_`."""
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.detach().mul_(coef.to(p.grad.device, p.grad.dtype))
