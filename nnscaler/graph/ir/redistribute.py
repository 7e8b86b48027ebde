"""The order in which a tensor's placements change, one mesh axis at a time, to go from one layout
to another. Pure layout algebra: partition turns each move into collectives, autodist costs them."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from nnscaler.graph.ir.layout import Layout, Partial, Placement, Replicate, Shard, mesh_layout, placements_of

__all__ = ["AxisMove", "redistribute_moves"]


@dataclass(frozen=True)
class AxisMove:
    """Change the placement on mesh `axis` from `src` to `dst` (a 1-D conversion over that axis's
    devices); `after` is the whole layout once done."""

    axis: int
    src: Placement
    dst: Placement
    after: Layout


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


@lru_cache(maxsize=1 << 14)  # layouts are frozen; the planner asks for the same pairs many times
def redistribute_moves(src: Layout, dst: Layout, naxes: int) -> tuple[AxisMove, ...]:
    """Per-axis moves from src to dst on an `naxes`-axis mesh, in two passes (DTensor's redistribute
    order): innermost axis first, undo what must change (gathers, reductions, all-to-alls); then
    outermost first, make the new shards (local splits). An inner shard that blocks a change is
    gathered first and remade in pass two. Raises ValueError when dst holds a partial sum src lacks."""
    if src == dst:
        return ()
    want = placements_of(dst, naxes)
    cur, moves = list(placements_of(src, naxes)), []

    def move(k: int, target: Placement) -> None:
        for blocker in reversed(_inner_blockers(cur, k, target)):
            move(blocker, Replicate())
        if cur[k] == target:
            return
        if isinstance(target, Partial):
            raise ValueError(f"no communication turns layout {src} into {dst}: nothing makes a partial sum")
        before, cur[k] = cur[k], target
        moves.append(AxisMove(k, before, target, mesh_layout(cur)))

    for k in reversed(range(naxes)):
        if cur[k] == want[k]:
            continue
        target = want[k]
        if isinstance(target, Shard) and (
            isinstance(cur[k], Replicate) or _outer_pending(cur, want, k, target)
        ):
            if isinstance(cur[k], Replicate):
                continue  # a local split: pass two
            target = Replicate()
        move(k, target)
    for k in range(naxes):
        if cur[k] != want[k]:
            move(k, want[k])
    return tuple(moves)
