"""Combining a step's micro-batch outputs over the data-parallel replicas, and scaling gradients.

`AggregatedOutputs` (nnScaler's) carries the sums the trainer needs: `loss_sum`, `num_batches` and,
for the `per-token-mean` reductions, `num_tokens`. `optimizer.aggregate_outputs_fn` may replace the
default, which takes each output's loss (the output itself, or its first element).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nnscaler.runtime import ParallelModule

__all__ = ["AggregatedOutputs", "default_aggregate", "scale_grads"]


@dataclass
class AggregatedOutputs:
    """Sums over every micro-batch of every replica in one step."""

    loss_sum: float | None = None
    """Sum of the micro-batch losses."""
    num_batches: int | None = None
    """Number of micro-batches."""
    num_tokens: int | None = None
    """Number of tokens (needed by the per-token-mean reductions)."""
    aggregated_outputs: Any = None
    """Anything else a custom aggregate_outputs_fn wants to hand to the hooks."""

    @classmethod
    def aggregate(
        cls,
        loss_outputs: list[Any],
        sync_group: dist.ProcessGroup | None,
        loss_fn: Callable[[Any], torch.Tensor],
        ntokens_fn: Callable[[Any], Any] | None = None,
    ) -> AggregatedOutputs:
        """Sum `loss_fn(output)` (and `ntokens_fn(output)`) over the outputs and over `sync_group`
        (the ranks at this rank's place in every data-parallel replica; None: no other replica)."""
        losses = [loss_fn(o).detach().reshape(()).to(torch.float64) for o in loss_outputs]
        device = losses[0].device if losses else torch.device("cpu")
        values = [
            torch.stack(losses).sum() if losses else torch.zeros((), dtype=torch.float64, device=device)
        ]
        values.append(torch.tensor(float(len(losses)), dtype=torch.float64, device=device))
        if ntokens_fn is not None:
            values.append(
                torch.stack(
                    [
                        torch.as_tensor(ntokens_fn(o), dtype=torch.float64, device=device).reshape(())
                        for o in loss_outputs
                    ]
                ).sum()
            )
        sums = torch.stack(values)
        if sync_group is not None:
            dist.all_reduce(sums, group=sync_group)
        return cls(
            loss_sum=float(sums[0]),
            num_batches=round(float(sums[1])),
            num_tokens=round(float(sums[2])) if ntokens_fn is not None else None,
        )


def _loss_of(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output[0]


def default_aggregate(outputs: list[Any], sync_group: dist.ProcessGroup | None) -> AggregatedOutputs:
    """The losses (each output, or its first element) summed over the outputs and the sync group."""
    return AggregatedOutputs.aggregate(outputs, sync_group, _loss_of)


def scale_grads(model: Any, factor: float) -> None:
    """Multiply the gradients the optimizer will read by `factor` (after the reduction): under ZeRO
    this rank's reduced slices in the reducer's buckets, elsewhere each parameter's `.grad` (or its
    fp32 `.main_grad`)."""
    with torch.no_grad():
        sharded: set[int] = set()
        for m in model.modules():
            red = m.reducer if isinstance(m, ParallelModule) else None
            if red is not None and red.zero:
                for piece in red.pieces:
                    piece.grad().mul_(factor)
                sharded.update(id(p) for p in red.params)
        for p in model.parameters():
            grad = p.grad if p.grad is not None else getattr(p, "main_grad", None)
            if p.requires_grad and id(p) not in sharded and grad is not None:
                grad.mul_(factor)
