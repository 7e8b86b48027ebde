"""How one tensor is laid out over a group of devices, in DTensor's vocabulary.

A stage's devices form a mesh (row-major ranks, axis 0 outermost). A 1-D layout (Replicate, Partial,
Shard) is the same placement on every axis: a Shard over all devices is the dim split on axis 0 and
each piece split again on axis 1 (nested), which is exactly today's p-way split. A MeshLayout gives
each axis its own placement, e.g. (S(0), S(2)): batch over axis 0, heads over axis 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "Layout",
    "Placement",
    "Replicate",
    "Shard",
    "Partial",
    "MeshLayout",
    "placements_of",
    "mesh_layout",
    "split_factors",
    "mesh_coords",
    "storage_shard",
    "layout_to_json",
    "layout_from_json",
]


@dataclass(frozen=True)
class Replicate:
    """Every device holds the whole tensor (nnScaler's R)."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    """Every device holds a full-shaped partial sum; the tensor is their sum (nnScaler's V)."""

    def __str__(self) -> str:
        return "P"


@dataclass(frozen=True)
class Shard:
    """Split along `dim` (nnScaler's D). With blocks > 1 the dim is viewed as `blocks` equal blocks and
    each device holds its piece of every block (e.g. the heads of fused q, k, v rows)."""

    dim: int
    blocks: int = 1

    def __str__(self) -> str:
        return f"S({self.dim})" if self.blocks == 1 else f"S({self.dim},blocks={self.blocks})"


Placement = Replicate | Partial | Shard


@dataclass(frozen=True)
class MeshLayout:
    """One placement per mesh axis (axis 0 outermost). Never all-equal: that is a 1-D layout (see
    `mesh_layout`), so plans without 2-D splits keep their 1-D layouts everywhere."""

    placements: tuple[Placement, ...]

    def __str__(self) -> str:
        return "(" + ", ".join(str(p) for p in self.placements) + ")"


Layout = Replicate | Partial | Shard | MeshLayout


def placements_of(layout: Layout, naxes: int) -> tuple[Placement, ...]:
    """The layout as one placement per axis of an `naxes`-axis mesh."""
    if isinstance(layout, MeshLayout):
        if len(layout.placements) != naxes:
            raise ValueError(f"layout {layout} has {len(layout.placements)} axes, the mesh {naxes}")
        return layout.placements
    return (layout,) * naxes


def mesh_layout(placements: tuple[Placement, ...] | list[Placement]) -> Layout:
    """The canonical layout of per-axis placements: the 1-D layout when every axis agrees."""
    placements = tuple(placements)
    if all(p == placements[0] for p in placements):
        return placements[0]
    return MeshLayout(placements)


def split_factors(layout: Layout, mesh: tuple[int, ...]) -> dict[int, int]:
    """dim -> how many pieces the layout cuts it into over `mesh` (a 1-D Shard: all devices)."""
    if isinstance(layout, Shard):
        return {layout.dim: math.prod(mesh)} if math.prod(mesh) > 1 else {}
    out: dict[int, int] = {}
    if isinstance(layout, MeshLayout):
        for p, size in zip(layout.placements, mesh):
            if isinstance(p, Shard) and size > 1:
                out[p.dim] = out.get(p.dim, 1) * size
    return out


def mesh_coords(index: int, mesh: tuple[int, ...]) -> tuple[int, ...]:
    """Coordinates of the device `index` (row-major) in the mesh."""
    coords = []
    for size in reversed(mesh):
        index, c = divmod(index, size)
        coords.append(c)
    return tuple(reversed(coords))


def storage_shard(layout: Layout, index: int, mesh: tuple[int, ...]) -> tuple[int, int, int, int] | None:
    """(dim, piece, pieces, blocks) device `index` of the mesh stores, None for the whole tensor.

    A stored tensor is cut along one dim at most: the axes that shard it must shard the same dim
    (nested, axis 0 outermost); the others hold copies. Raises ValueError for anything else."""
    ways = math.prod(mesh)
    if isinstance(layout, Shard):
        return (layout.dim, index, ways, layout.blocks) if ways > 1 else None
    if isinstance(layout, (Replicate, Partial)):
        return None
    coords = mesh_coords(index, mesh)
    axes = [(k, p) for k, p in enumerate(layout.placements) if isinstance(p, Shard) and mesh[k] > 1]
    if not axes:
        return None
    if len({p for _, p in axes}) > 1:
        raise ValueError(f"a stored tensor is split along one dim at most; layout {layout} splits several")
    piece, pieces = 0, 1
    for k, _ in axes:
        piece, pieces = piece * mesh[k] + coords[k], pieces * mesh[k]
    dim, blocks = axes[0][1].dim, axes[0][1].blocks
    return (dim, piece, pieces, blocks)


def _placement_to_json(p: Placement) -> dict:
    if isinstance(p, Shard):
        return {"shard": p.dim, "blocks": p.blocks}
    return {"replicate": True} if isinstance(p, Replicate) else {"partial": True}


def _placement_from_json(data: dict) -> Placement:
    if "shard" in data:
        return Shard(data["shard"], data.get("blocks", 1))
    return Replicate() if "replicate" in data else Partial()


def layout_to_json(layout: Layout) -> dict:
    if isinstance(layout, MeshLayout):
        return {"mesh": [_placement_to_json(p) for p in layout.placements]}
    return _placement_to_json(layout)


def layout_from_json(data: dict) -> Layout:
    if "mesh" in data:
        return mesh_layout([_placement_from_json(p) for p in data["mesh"]])
    return _placement_from_json(data)
