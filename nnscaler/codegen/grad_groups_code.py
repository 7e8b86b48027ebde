"""`reduce_grad_over` lines: weights held whole along plan axes where every reader is split on data dims
(`Program.grad_groups`). The gradient reducer sums their gradients over those axes' ranks together with
the data-parallel replicas; every rank creates each such group at init (new_group is collective)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from nnscaler.codegen.safe_text import literal
from nnscaler.config import ComputeConfig
from nnscaler.mesh import rank_axis_groups
from nnscaler.partition import GROUP, AxisGroup, Program

__all__ = ["grad_group_ranks", "grad_group_lines", "all_grad_groups"]

TpGroup = Callable[[int], list[int]]
"""rank -> the ranks of its tensor-parallel group (its stage's devices in one replica)."""


def _axis_ranks(tp_group: TpGroup, mesh: tuple[int, ...], rank: int, group) -> list[int]:
    if group is GROUP:
        return tp_group(rank)
    if isinstance(group, AxisGroup):
        return rank_axis_groups(tp_group(rank), mesh, rank)[f"tp_axis{group.axis}"]
    raise TypeError(f"grad_groups holds {group!r}: expected GROUP or AxisGroup")


def grad_group_ranks(
    cfg: ComputeConfig, tp_group: TpGroup, mesh: tuple[int, ...], rank: int, groups: tuple
) -> list[int]:
    """The ranks `rank` sums such a gradient with: those differing from it only in the coordinates of
    `groups` (plan axes) or in the data-parallel replica."""
    members = {rank}
    for group in groups:
        members = {y for x in members for y in _axis_ranks(tp_group, mesh, x, group)}
    return sorted({y for x in members for y in cfg.dims.dp_group(x)})


def grad_group_lines(
    programs: Sequence[Program], cfg: ComputeConfig, tp_group: TpGroup, rank: int
) -> list[str]:
    """One `self.reduce_grad_over(name, ranks)` line per weight of the `grad_groups` of `programs` (the
    programs this rank runs: its stages)."""
    return [
        f"self.reduce_grad_over({literal(name)}, {grad_group_ranks(cfg, tp_group, p.mesh, rank, groups)})"
        "  # replicated where its readers split the batch: the reducer sums it"
        for p in programs
        for name, groups in p.grad_groups.items()
    ]


def all_grad_groups(
    programs: Sequence[tuple[Program, Sequence[int]]], cfg: ComputeConfig, tp_group: TpGroup
) -> list[list[int]]:
    """The groups of every (program, the ranks running it) (each rank creates them all, in this order)."""
    out: list[list[int]] = []
    for program, ranks in programs:
        for groups in dict.fromkeys(program.grad_groups.values()):
            for rank in ranks:
                found = grad_group_ranks(cfg, tp_group, program.mesh, rank, groups)
                if found not in out:
                    out.append(found)
    return out
