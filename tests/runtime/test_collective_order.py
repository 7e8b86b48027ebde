"""Collectives on several communicators are issued in one program order on every rank (issue 11).

NCCL requires every rank to issue its collectives, across all communicators, in the same order. ZeRO
with `zero_ngroups > 1` uses two: the ZeRO group (reduce-scatter of each bucket) and the cross group
(all-reduce of the slice). Here 4 gloo ranks run the stage-2 reducer (async, one bucket per tensor)
while `Bucket.done` lies about timing: on ranks 0 and 2 every collective looks complete at once (a
fast network), on ranks 1 and 3 never (a slow one). Each rank records the collectives it issues
(operation, communicator, bucket); the records must be equal. Before the fix the fast ranks started
a bucket's cross-group all-reduce as soon as its reduce-scatter was complete, the slow ones later.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

try:
    from .dist_util import run_dist
except ImportError:
    from dist_util import run_dist

WORLD = 4
NGROUPS = 2


def _issue_order(rank: int, world: int) -> list[tuple[str, str, int]]:
    import nnscaler.runtime.grads.buckets as buckets
    from nnscaler.runtime.grads.reducer import Reducer, zero_process_groups

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    zero, cross = zero_process_groups(rank, world, 1, NGROUPS)
    red = Reducer(
        list(model.parameters()),
        dist.group.WORLD,
        bucket_cap_mb=0,
        zero_group=zero,
        cross_group=cross,
        stage=2,
    )
    names = {id(zero): "zero", id(cross): "cross", id(dist.group.WORLD): "dp"}
    record: list[tuple[str, str, int]] = []
    scatter, all_reduce = buckets._reduce_scatter_single, dist.all_reduce

    def bucket_of(t: torch.Tensor) -> int:
        return next((k for k, b in enumerate(red.buckets) if t is b.grads or t is b._scatter_out), -1)

    def rec_scatter(out: torch.Tensor, inp: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
        record.append(("reduce_scatter", names.get(id(group), "?"), bucket_of(inp)))
        return scatter(out, inp, group=group, async_op=async_op)

    def rec_all_reduce(t: torch.Tensor, *args: Any, group: Any = None, **kwargs: Any) -> Any:
        record.append(("all_reduce", names.get(id(group), "?"), bucket_of(t)))
        return all_reduce(t, *args, group=group, **kwargs)

    fast = rank % 2 == 0

    def done(self: Any) -> bool:
        if fast:
            self.wait()
        return fast

    buckets._reduce_scatter_single = rec_scatter
    dist.all_reduce = rec_all_reduce
    buckets.Bucket.done = done
    try:
        for step in range(2):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank * 10 + step))
            model(x).square().sum().backward()
            red.sync()
            red.zero_grad()
    finally:
        buckets._reduce_scatter_single, dist.all_reduce = scatter, all_reduce
    return record


def test_zero_ngroups_collectives_issue_in_one_order_on_every_rank() -> None:
    orders = run_dist(_issue_order, WORLD, timeout=60.0)
    kinds = {(op, group) for op, group, _ in orders[0]}
    assert kinds == {("reduce_scatter", "zero"), ("all_reduce", "cross")}, orders[0]
    assert len(orders[0]) == 2 * 2 * 8  # 2 steps x 8 buckets x (reduce-scatter + cross all-reduce)
    for rank, order in enumerate(orders[1:], start=1):
        assert order == orders[0], (
            f"rank {rank} issued its collectives in another order than rank 0:\n"
            f"rank 0: {orders[0]}\nrank {rank}: {order}"
        )
