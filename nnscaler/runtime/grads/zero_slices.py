"""ZeRO bookkeeping shared by the reducers: a parameter's piece of this rank's slice, and the ZeRO
process groups of the data-parallel groups."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nnscaler.mesh import ParallelDims
from nnscaler.runtime.dist.groups import create_groups, get_group
from nnscaler.runtime.grads.buckets import Bucket

__all__ = ["ZeroPiece", "zero_process_groups", "zero_groups"]


@dataclass(frozen=True, eq=False)
class ZeroPiece:
    """One parameter's part of this rank's ZeRO slice: an optimizer parameter viewing the flat buffer."""

    source: torch.nn.Parameter
    """The module's parameter."""
    param: torch.nn.Parameter
    """What the optimizer updates: elements `[start, end)` of the flattened `source`, sharing memory."""
    start: int
    end: int
    bucket: Bucket
    offset: int
    """Where the piece starts in the bucket."""

    def grad(self) -> torch.Tensor:
        """The reduced gradient of the piece (after `Reducer.sync`)."""
        lo = self.bucket.own[0]
        owned = self.bucket.owned_grads()
        return owned[self.offset - lo : self.offset - lo + self.end - self.start]


def zero_process_groups(
    rank: int, world_size: int, plan_ngpus: int, ngroups: int
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """This rank's ZeRO group and cross group (`zero_groups` of its data-parallel group); None for a
    group of one rank. Collective: creates the groups of every data-parallel group, in the same order
    on every rank."""
    parts, crosses = ParallelDims(plan_ngpus, world_size, ngroups).all_zero_groups()
    create_groups(parts + crosses)
    zero_group = get_group(next(g for g in parts if rank in g))
    cross_group = get_group(next(g for g in crosses if rank in g))
    return zero_group, cross_group


def zero_groups(dp_ranks: Sequence[int], ngroups: int) -> tuple[list[list[int]], list[list[int]]]:
    """nnScaler's ZeRO groups of one data-parallel group (see `ParallelDims.zero_parts`)."""
    return ParallelDims(1, len(dp_ranks), ngroups).zero_parts(list(dp_ranks))
