"""Communication between layouts: the collective that turns a producer's layout into a consumer's."""

from __future__ import annotations

from dataclasses import dataclass, replace

from nnscaler.errors import PartitionError
from nnscaler.graph.ir import (
    Layout,
    MeshLayout,
    Partial,
    Placement,
    Replicate,
    Shard,
    mesh_layout,
    placements_of,
    redistribute_moves,
)

__all__ = ["GROUP", "AxisGroup", "CommStep", "conversion_steps"]


@dataclass(frozen=True)
class _Group:
    """Stands for the tensor-parallel process group in a statement's args."""

    def __repr__(self) -> str:
        return "GROUP"


GROUP = _Group()


@dataclass(frozen=True)
class AxisGroup:
    """Stands for the devices of one mesh axis through this rank (same coordinates on the other axes)."""

    axis: int

    def __repr__(self) -> str:
        return f"GROUP_AXIS{self.axis}"


@dataclass(frozen=True)
class CommStep:
    """One collective: the runtime function, its extra positional args and kwargs, the name suffix."""

    fn: str
    args: tuple
    kwargs: tuple[tuple[str, int], ...]
    suffix: str
    result: Layout


def _blocks(b: int) -> tuple[tuple[str, int], ...]:
    return (("blocks", b),) if b > 1 else ()


def conversion_steps(src: Layout, dst: Layout, naxes: int = 1) -> list[CommStep]:
    """The collectives that turn src into dst (empty when they are equal) on a mesh of `naxes` axes.

    1-D layouts convert over the whole group (GROUP); a MeshLayout on either side converts one axis at a
    time over that axis's devices (AxisGroup), see `_mesh_steps`."""
    if src == dst:
        return []
    if isinstance(src, MeshLayout) or isinstance(dst, MeshLayout):
        return _mesh_steps(src, dst, naxes)
    return _placement_steps(src, dst)


def _placement_steps(src: Placement, dst: Placement) -> list[CommStep]:
    if src == dst:
        return []
    if isinstance(src, Replicate) and isinstance(dst, Shard):
        return [CommStep("split_to_group", (dst.dim, GROUP), _blocks(dst.blocks), "local", dst)]
    if isinstance(src, Shard) and isinstance(dst, Replicate):
        return [CommStep("gather_from_group", (src.dim, GROUP), _blocks(src.blocks), "gathered", dst)]
    if isinstance(src, Partial) and isinstance(dst, Replicate):
        return [CommStep("reduce_from_group", (GROUP,), (), "reduced", dst)]
    if isinstance(src, Partial) and isinstance(dst, Shard):
        return [CommStep("reduce_scatter_to_group", (dst.dim, GROUP), _blocks(dst.blocks), "scattered", dst)]
    if isinstance(src, Shard) and isinstance(dst, Shard):
        if src.blocks == dst.blocks == 1 and src.dim != dst.dim:
            return [CommStep("all_to_all_in_group", (src.dim, dst.dim, GROUP), (), "a2a", dst)]
        return _placement_steps(src, Replicate()) + _placement_steps(Replicate(), dst)
    raise PartitionError(f"no communication turns layout {src} into {dst}")


def _mesh_steps(src: Layout, dst: Layout, naxes: int) -> list[CommStep]:
    """The 1-D conversion of each per-axis move (see redistribute_moves) over that axis's devices."""
    try:
        moves = redistribute_moves(src, dst, naxes)
    except ValueError as exc:
        raise PartitionError(str(exc)) from None
    cur, steps = list(placements_of(src, naxes)), []
    for m in moves:
        for step in _placement_steps(m.src, m.dst):
            cur[m.axis] = step.result
            args = tuple(AxisGroup(m.axis) if a is GROUP else a for a in step.args)
            steps.append(replace(step, args=args, result=mesh_layout(cur)))
    return steps
