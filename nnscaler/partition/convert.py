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
        return _mesh_steps(placements_of(src, naxes), placements_of(dst, naxes))
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


def _inner_blockers(cur: list[Placement], k: int, target: Placement) -> list[int]:
    """Inner axes whose shards stop axis k going from cur[k] to target now.

    Shards of one dim over several axes are nested, axis 0 outermost: a shard on axis k may be undone,
    or made, only while no inner axis shards that dim."""
    dims = {p.dim for p in (cur[k], target) if isinstance(p, Shard)}
    return [j for j in range(k + 1, len(cur)) if isinstance(cur[j], Shard) and cur[j].dim in dims]


def _outer_pending(cur: list[Placement], want: tuple[Placement, ...], k: int, target: Placement) -> bool:
    """Must an outer axis still shard target's dim before axis k may (the outer one is outermost)?"""
    if not isinstance(target, Shard):
        return False
    return any(
        isinstance(want[i], Shard) and want[i].dim == target.dim and cur[i] != want[i] for i in range(k)
    )


def _mesh_steps(src: tuple[Placement, ...], want: tuple[Placement, ...]) -> list[CommStep]:
    """Per-axis conversions in two passes (DTensor's redistribute order): innermost axis first, undo
    what must change (gathers, reductions, all-to-alls); then outermost first, make the new shards
    (local splits). An inner shard that blocks a change is gathered first and remade in pass two."""
    cur, steps = list(src), []

    def convert_axis(k: int, target: Placement) -> None:
        for blocker in reversed(_inner_blockers(cur, k, target)):
            convert_axis(blocker, Replicate())
        for step in _placement_steps(cur[k], target):
            cur[k] = step.result
            args = tuple(AxisGroup(k) if a is GROUP else a for a in step.args)
            steps.append(replace(step, args=args, result=mesh_layout(cur)))

    for k in reversed(range(len(cur))):
        if cur[k] == want[k]:
            continue
        target = want[k]
        if isinstance(target, Shard) and (
            isinstance(cur[k], Replicate) or _outer_pending(cur, want, k, target)
        ):
            if isinstance(cur[k], Replicate):
                continue  # a local split: pass two
            target = Replicate()
        convert_axis(k, target)
    for k in range(len(cur)):
        if cur[k] != want[k]:
            convert_axis(k, want[k])
    if tuple(cur) != tuple(want):
        raise PartitionError(f"no communication turns layout {mesh_layout(src)} into {mesh_layout(want)}")
    return steps
