"""A pipelined call of the module in Lightning: the micro-batches' whole forward outputs made one.

`train_step(..., return_outputs=True)` gives every micro-batch's output (loss first); the module call
returns the forward's structure with, per leaf: the loss, the mean over micro-batches (in training a
leaf that requires grad: Lightning's backward on it is a no-op, the schedule already ran backward);
other floating-point scalars, their mean; integer scalars (counts), their sum; tensors with dims,
concatenated along dim 0 (the batch); anything else, the first micro-batch's value."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["combine_micro_outputs"]


def _combine(values: list[Any]) -> Any:
    if not all(isinstance(v, torch.Tensor) for v in values):
        return values[0]
    if values[0].dim() > 0:
        return torch.cat(values, dim=0)
    stacked = torch.stack(values)
    return stacked.mean() if stacked.is_floating_point() else stacked.sum()


def combine_micro_outputs(outputs: list[Any], train: bool) -> Any:
    """See the module docstring."""
    flat = [pytree.tree_flatten(o) for o in outputs]
    spec = flat[0][1]
    leaves = [_combine(list(column)) for column in zip(*(f[0] for f in flat))]
    loss = torch.stack([f[0][0].detach().float() for f in flat]).mean()
    leaves[0] = loss.requires_grad_() if train else loss
    return pytree.tree_unflatten(leaves, spec)
