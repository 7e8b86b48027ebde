"""Batch norm whose statistics span the data-parallel replicas (so training matches one device)."""

from __future__ import annotations

import torch

from nnscaler.runtime.comm import Group, copy_to_group, group_size, reduce_from_group

__all__ = ["sync_batch_norm"]


def _all_reduce_both_ways(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum over the group in forward and in backward: every replica's loss depends on the total."""
    return reduce_from_group(copy_to_group(x, group), group)


def sync_batch_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
    group: Group,
) -> torch.Tensor:
    """F.batch_norm over the union of the replicas' batches (aten.batch_norm's argument order).

    Per-channel sums and sums of squares are all-reduced (and so are their gradients); with
    gradients averaged over replicas this equals single-device training on the whole batch.
    Outside training, or without a group, it is plain batch norm.
    """
    if not training or group is None or group_size(group) == 1:
        return torch.nn.functional.batch_norm(
            x, running_mean, running_var, weight, bias, training, momentum, eps
        )
    dims = [0] + list(range(2, x.dim()))
    count = torch.full((), float(x.numel() // x.shape[1]), dtype=x.dtype, device=x.device)  # no H2D copy
    stats = torch.cat([x.sum(dims), (x * x).sum(dims), count.reshape(1)])
    stats = _all_reduce_both_ways(stats, group)
    channels = x.shape[1]
    total = stats[-1]
    mean = stats[:channels] / total
    var = stats[channels : 2 * channels] / total - mean * mean
    shape = [1, channels] + [1] * (x.dim() - 2)
    y = (x - mean.reshape(shape)) * torch.rsqrt(var.reshape(shape) + eps)
    if weight is not None:
        y = y * weight.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    if running_mean is not None and running_var is not None:
        with torch.no_grad():
            unbiased = var * (total / (total - 1).clamp(min=1))
            running_mean.mul_(1 - momentum).add_(mean.detach(), alpha=momentum)
            running_var.mul_(1 - momentum).add_(unbiased.detach(), alpha=momentum)
    return y
