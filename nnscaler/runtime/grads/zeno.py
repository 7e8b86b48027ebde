"""Zeno (Xie, Koyejo, Gupta 2019; ZenoPS): keep the n - b data-parallel replicas whose gradients
score best on a validation micro-batch, average those.

score(g) = f(x) - f(x - gamma * g) - rho * ||g||^2

f is the validation loss (a forward pass; `Zeno.loss_fn`, set by the ParallelModule), x the weights,
g the replica's whole gradient (the sum over tensor-parallel shards for the norm: `Zeno.sq_norm_fn`).
Each replica scores its own gradient (the plan's ranks together, so tensor parallelism works), the
n scores are all-gathered over the data-parallel group (n floats), and every rank keeps the same
n - b best (a NaN score is the worst; ties go to the lower replica index). A kept replica's bucket is
scaled by n / (n - b), a dropped one's is zeroed (so NaN or inf never travel), and the buckets are then
reduced as for the mean: the same all-reduce or ZeRO reduce-scatter, so the traffic is the mean's
plus n floats; the price is two forward passes per step and no overlap of the reduction with backward
(the scores must be known first).

What it trusts: a replica scores its own gradient, so it catches gradients corrupted after they were
computed or computed from bad data (when the validation batch is clean), not a replica that also
computes its score wrongly; the coordinate-wise rules (robust.py) need no such trust.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist

from nnscaler.errors import ConfigError
from nnscaler.runtime.comm import _all_gather_single

__all__ = ["Zeno", "zeno_keep", "perturbed"]


def zeno_keep(scores: Sequence[float], b: int) -> list[bool]:
    """Which replicas to keep: the `len(scores) - b` best scores (NaN is worst; ties: lower index)."""
    n = len(scores)
    key = [(-float("inf") if s != s else s) for s in scores]
    order = sorted(range(n), key=lambda k: (-key[k], k))
    kept = set(order[: n - b])
    return [k in kept for k in range(n)]


@contextmanager
def perturbed(grads: Sequence[tuple[torch.nn.Parameter, torch.Tensor]], step: float) -> Iterator[None]:
    """Inside: each parameter's values are `x - step * g` (new tensors); restored exactly after."""
    saved = [p.data for p, _ in grads]
    try:
        for p, g in grads:
            p.data = p.data - step * g.to(p.dtype).view(p.shape)
        yield
    finally:
        for (p, _), data in zip(grads, saved):
            p.data = data


class Zeno:
    """The selection over one data-parallel group; the ParallelModule supplies `loss_fn` (the validation
    loss of the module as it is, a forward pass without grad) and `sq_norm_fn` (||g||^2 over one replica)."""

    def __init__(self, group: dist.ProcessGroup, b: int, gamma: float, rho: float) -> None:
        self.group, self.b, self.gamma, self.rho = group, b, gamma, rho
        self.n = dist.get_world_size(group)
        self.me = dist.get_rank(group)
        self.loss_fn: Callable[[], torch.Tensor] | None = None
        self.sq_norm_fn: (
            Callable[[Sequence[tuple[torch.nn.Parameter, torch.Tensor]]], torch.Tensor] | None
        ) = None
        self.last_scores: list[float] = []

    def score(
        self, grads: Sequence[tuple[torch.nn.Parameter, torch.Tensor]], scale: float = 1.0
    ) -> torch.Tensor:
        """This replica's score (an fp32 scalar) of its gradient: `scale` times the `grads` given as
        (parameter, tensor) pairs (the reducer's buckets hold the gradient divided by its divisor)."""
        if self.loss_fn is None:
            raise ConfigError(
                "ComputeConfig.grad_aggregation='zeno' needs a validation loss to score gradients with: use "
                "train_step (end-to-end mode; it scores on the step's last micro-batch), or call "
                "module.set_zeno_batch(batch) or module.set_zeno_scorer(fn) before the optimizer step "
                "(docs/faulty_replicas.md)"
            )
        with torch.no_grad():
            before = self.loss_fn().detach().float()
            with perturbed(grads, self.gamma * scale):
                after = self.loss_fn().detach().float()
            sq = self.sq_norm_fn(grads) if self.sq_norm_fn is not None else _sq_norm(grads)
            sq = sq.float().to(before.device) * scale**2
        return (before - after - self.rho * sq).reshape(())

    def select(
        self, grads: Sequence[tuple[torch.nn.Parameter, torch.Tensor]], scale: float = 1.0
    ) -> list[bool]:
        """Score (see `score`), all-gather the scores over the group, return which replicas are kept
        (the same on every rank)."""
        mine = self.score(grads, scale).reshape(1)
        everyone = torch.empty(self.n, dtype=mine.dtype, device=mine.device)
        _all_gather_single(everyone, mine, group=self.group)
        self.last_scores = everyone.tolist()
        return zeno_keep(self.last_scores, self.b)

    def weight(self, keep: Sequence[bool]) -> float:
        """What this rank's (divided) bucket values are multiplied by: n / (n - b) when kept, else 0."""
        return self.n / (self.n - self.b) if keep[self.me] else 0.0


def _sq_norm(grads: Sequence[tuple[torch.nn.Parameter, torch.Tensor]]) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float32)
    for _, g in grads:
        total = total + g.float().square().sum().cpu()
    return total
