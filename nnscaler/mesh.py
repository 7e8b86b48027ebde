"""Rank arithmetic of a run, in one place (torchtitan's ParallelDims): which ranks form one copy of the
plan, which hold the same plan device (a data-parallel group), and how ZeRO divides a data-parallel
group. Config, codegen and the runtime all ask it; nothing else computes ranks.

A run has `world_size` ranks in `world_size // plan_ngpus` data-parallel replicas; replica d runs the
plan on the consecutive ranks `d * plan_ngpus ... d * plan_ngpus + plan_ngpus - 1`, so global rank
= replica * plan_ngpus + plan index. Inside the plan, the pipeline-stage and tensor-parallel groups are
the plan's own (its device groups, written into the generated code); this module knows the axes that
every plan has: plan, dp and ZeRO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ParallelDims", "mesh_axis_groups", "rank_axis_groups", "hybrid_cp_subgroups"]


@dataclass(frozen=True)
class ParallelDims:
    """The plan / data-parallel / ZeRO axes of `world_size` ranks."""

    plan_ngpus: int
    """Ranks one copy of the plan spans."""
    world_size: int
    """All ranks of the run."""
    zero_ngroups: int = 1
    """ZeRO: consecutive parts each data-parallel group is divided into (state is sharded within one)."""

    def __post_init__(self) -> None:
        if self.plan_ngpus < 1 or self.world_size < 1 or self.world_size % self.plan_ngpus:
            raise ValueError(
                f"world_size ({self.world_size}) must be a positive multiple of plan_ngpus ({self.plan_ngpus})"
            )
        if self.zero_ngroups < 1 or self.dp_size % self.zero_ngroups:
            raise ValueError(
                f"zero_ngroups={self.zero_ngroups} must divide the data-parallel size {self.dp_size}"
            )

    @property
    def dp_size(self) -> int:
        """Number of data-parallel replicas of the plan."""
        return self.world_size // self.plan_ngpus

    def replica(self, rank: int) -> int:
        """The data-parallel replica `rank` belongs to (its data-parallel rank)."""
        return rank // self.plan_ngpus

    def plan_index(self, rank: int) -> int:
        """The plan device `rank` runs."""
        return rank % self.plan_ngpus

    def plan_group(self, rank: int) -> list[int]:
        """Ranks that run one copy of the plan with `rank`."""
        start = self.replica(rank) * self.plan_ngpus
        return list(range(start, start + self.plan_ngpus))

    def dp_group(self, rank: int) -> list[int]:
        """Ranks that hold the same plan device as `rank` (its data-parallel group)."""
        return list(range(self.plan_index(rank), self.world_size, self.plan_ngpus))

    def plan_groups(self) -> list[list[int]]:
        """Every copy of the plan, by replica."""
        return [self.plan_group(d * self.plan_ngpus) for d in range(self.dp_size)]

    def dp_groups(self) -> list[list[int]]:
        """Every data-parallel group, by plan device."""
        return [self.dp_group(i) for i in range(self.plan_ngpus)]

    def zero_parts(self, dp_ranks: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """nnScaler's ZeRO groups of one data-parallel group: `zero_ngroups` consecutive parts (state is
        sharded within each) and the cross groups (the ranks with the same index in every part).

        E.g. ranks [0, 2, 4, 6] with 2 groups: parts [0, 2], [4, 6]; cross groups [0, 4], [2, 6]."""
        n = len(dp_ranks)
        if n % self.zero_ngroups:
            raise ValueError(
                f"ComputeConfig.zero_ngroups={self.zero_ngroups} must divide the data-parallel size {n} "
                f"(ranks {list(dp_ranks)})"
            )
        size = n // self.zero_ngroups
        parts = [list(dp_ranks[k * size : (k + 1) * size]) for k in range(self.zero_ngroups)]
        cross = [list(dp_ranks[j::size]) for j in range(size)]
        return parts, cross

    def all_zero_groups(self) -> tuple[list[list[int]], list[list[int]]]:
        """The ZeRO parts and cross groups of every data-parallel group (in plan-device order)."""
        parts: list[list[int]] = []
        crosses: list[list[int]] = []
        for dp_ranks in self.dp_groups():
            p, c = self.zero_parts(dp_ranks)
            parts += p
            crosses += c
        return parts, crosses


def mesh_axis_groups(tp_group: list[int], mesh: tuple[int, ...]) -> list[list[list[int]]]:
    """Per axis of `mesh` laid over `tp_group` (row-major, axis 0 outermost): the groups of its ranks that
    differ only in that axis's coordinate, e.g. [[0, 2], [1, 3]] and [[0, 1], [2, 3]] for a 2 x 2 mesh."""
    if len(tp_group) != math.prod(mesh):
        raise ValueError(f"a mesh {tuple(mesh)} needs {math.prod(mesh)} ranks, the group has {len(tp_group)}")
    out = []
    for k in range(len(mesh)):
        stride = math.prod(mesh[k + 1 :])
        groups = []
        for i in range(len(tp_group)):
            if (i // stride) % mesh[k] == 0:  # the first rank along axis k
                groups.append([tp_group[i + j * stride] for j in range(mesh[k])])
        out.append(groups)
    return out


def rank_axis_groups(tp_group: list[int], mesh: tuple[int, ...], rank: int) -> dict[str, list[int]]:
    """The groups named `tp_axis{k}` that generated code uses for `rank` (a member of `tp_group`)."""
    return {
        f"tp_axis{k}": next(g for g in groups if rank in g)
        for k, groups in enumerate(mesh_axis_groups(tp_group, mesh))
    }


def hybrid_cp_subgroups(cp_group: list[int], ulysses_size: int) -> list[list[int]]:
    """Hybrid context parallelism over `cp_group`: its Ulysses groups (consecutive runs of
    `ulysses_size` of its sorted ranks) and its ring groups (the ranks at one position of every
    Ulysses group). The runtime's kernels look these up; every rank creates them at init."""
    ranks = sorted(cp_group)
    inner = [ranks[i : i + ulysses_size] for i in range(0, len(ranks), ulysses_size)]
    rings = [ranks[j::ulysses_size] for j in range(ulysses_size)]
    return inner + rings
