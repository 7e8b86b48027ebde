"""Operations on gradients outside the reducer: averaging a list of gradients, the gradient an
optimizer reads, squared norms (foreach, on device), which rank counts a replicated piece in a norm,
and clip scaling with the coefficient kept on the device."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from nnscaler.runtime.grads.buckets import make_buckets

__all__ = ["average_gradients", "param_grad", "grad_sq_norm", "sq_norm_of", "first_holders", "scale_grads"]


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


def param_grad(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient an optimizer reads for `p`: `p.main_grad` (fp32, set by a reducer with
    `reduce_grads_in_fp32`) when present, else `p.grad`."""
    main = getattr(p, "main_grad", None)
    return main if main is not None else p.grad


def grad_sq_norm(params: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """Sum of squared gradient entries of `params` (fp32 scalar; parameters without grad count 0)."""
    grads = [g for g in (param_grad(p) for p in params) if g is not None]
    return sq_norm_of(grads, device)


def sq_norm_of(tensors: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """Sum of squared entries of `tensors` as an fp32 device scalar: one `torch._foreach_norm` per
    (device, dtype) group, no host sync."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            groups.setdefault((t.device, t.dtype), []).append(t.detach())
    for ts in groups.values():
        norms = torch._foreach_norm(ts, 2.0)
        total = total + torch.linalg.vector_norm(torch.stack(norms).float()).square().to(total.device)
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
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)  # stays on device: no host sync
    grads = {id(g): g for p in params for g in (p.grad, getattr(p, "main_grad", None)) if g is not None}
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads.values():
        groups.setdefault((g.device, g.dtype), []).append(g.detach())
    for (device, dtype), gs in groups.items():
        torch._foreach_mul_(gs, coef.to(device, dtype))
