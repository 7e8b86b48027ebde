"""Coordinate-wise robust rules over the data-parallel replicas' gradients, and their transport.

`coordinate_rule(values, mode, b)` is the rule itself: `values` stacks one row per replica; per
coordinate the rows are sorted (NaN sorts above +inf, so it is trimmed like a huge value) and the
values in a window of sorted positions are averaged:
- `median`: the middle value (odd n) or the mean of the two middle values (even n);
- `trimmed_mean`: positions b .. n - b - 1 (the b largest and b smallest values dropped).

`SliceAggregator` runs it on the reducer's buckets without any rank holding every replica's whole
bucket: one all-to-all hands rank j the j-th slice of every replica's bucket (B/n elements from each
of the n replicas: B elements received, B more held), it applies the rule to that slice, and one
all-gather gives every rank the whole aggregated bucket (B more) — or, under ZeRO with reduce-scatter,
rank j keeps its slice, which is the one it owns. Per rank that moves (n-1)/n * B out in the all-to-all
and (n-1)/n * B in the all-gather: what a ring all-reduce moves.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from nnscaler.runtime.comm import _all_gather_single
from nnscaler.runtime.grads.buckets import Bucket

__all__ = ["COORDINATE_MODES", "window", "coordinate_rule", "SliceAggregator"]

COORDINATE_MODES = ("median", "trimmed_mean")


def window(n: int, mode: str, b: int) -> tuple[int, int]:
    """The sorted positions `[lo, hi)` whose values `mode` averages, among `n` replicas."""
    if mode == "median":
        return ((n - 1) // 2, n // 2 + 1)
    if mode == "trimmed_mean":
        if n <= 2 * b:
            raise ValueError(f"trimmed_mean with b={b} needs more than {2 * b} replicas, got {n}")
        return (b, n - b)
    raise ValueError(f"unknown coordinate-wise rule {mode!r}; known: {COORDINATE_MODES}")


def coordinate_rule(values: torch.Tensor, mode: str, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`mode` applied per coordinate to `values` (shape `[n, m]`, one row per replica).

    Returns the aggregate (shape `[m]`, the dtype of `values`; averaged in fp32) and, per replica, how
    many of its `m` values fell outside the averaged window (int64, shape `[n]`).
    """
    n = values.shape[0]
    lo, hi = window(n, mode, b)
    ordered, order = torch.sort(values, dim=0)  # ties hold equal values: the aggregate is the same
    agg = ordered[lo:hi].float().mean(dim=0).to(values.dtype)
    outside = torch.cat([order[:lo].reshape(-1), order[hi:].reshape(-1)])
    return agg, torch.bincount(outside, minlength=n)[:n]


class SliceAggregator:
    """A coordinate-wise rule over `group` (the data-parallel group) for the reducer's buckets.

    `start(bucket)` launches the all-to-all of a prepared bucket (its values divided by the reducer's
    divisor) and returns the work; `take(bucket)`, after that work is done, applies the rule to this
    rank's slice, multiplies by n (so a divisor of n gives the robust mean, 1 the robust sum) and
    returns the slice (`scatter`) or all-gathers it into the bucket. `outside` and `coords` count, for
    this rank's slices since `take_counts`, the coordinates each replica had trimmed away.
    """

    def __init__(self, mode: str, b: int, group: dist.ProcessGroup, scatter: bool) -> None:
        self.mode, self.b, self.group, self.scatter = mode, b, group, scatter
        self.n = dist.get_world_size(group)
        window(self.n, mode, b)  # refuse a rule that cannot run on n replicas, here rather than mid-step
        self.outside: torch.Tensor | None = None
        self.coords = 0
        self._recv: dict[int, torch.Tensor] = {}

    def start(self, bucket: Bucket) -> Any:
        grads = bucket.prepare()  # prepared already (by the reducer): returns the values
        chunk = -(-bucket.size // self.n)
        send = grads
        if chunk * self.n != bucket.size:  # buckets are padded to n only under ZeRO
            send = torch.zeros(chunk * self.n, dtype=grads.dtype, device=grads.device)
            send[: bucket.size].copy_(grads)
        recv = torch.empty(self.n, chunk, dtype=grads.dtype, device=grads.device)
        self._recv[id(bucket)] = recv
        return dist.all_to_all_single(recv.view(-1), send, group=self.group, async_op=True)

    def take(self, bucket: Bucket) -> torch.Tensor | None:
        recv = self._recv.pop(id(bucket))
        mine, outside = coordinate_rule(recv, self.mode, self.b)
        mine.mul_(self.n)
        self.outside = outside if self.outside is None else self.outside + outside
        self.coords += recv.shape[1]
        if self.scatter:
            return mine
        whole = torch.empty(self.n * mine.numel(), dtype=mine.dtype, device=mine.device)
        _all_gather_single(whole, mine, group=self.group)
        assert bucket.grads is not None
        bucket.grads.copy_(whole[: bucket.size])
        return None

    def take_counts(self) -> tuple[torch.Tensor, int] | None:
        """Per replica, the coordinates trimmed away since the last call, summed over the group (a
        collective: every rank calls it at the same point), and the coordinates counted; None when no
        bucket was aggregated since."""
        if self.outside is None:
            return None
        both = torch.cat([self.outside, torch.tensor([self.coords], device=self.outside.device)])
        dist.all_reduce(both, group=self.group)
        self.outside, self.coords = None, 0
        return both[:-1], int(both[-1])
