"""How one tensor is laid out over a group of devices, in DTensor's vocabulary."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Layout", "Replicate", "Shard", "Partial", "layout_to_json", "layout_from_json"]


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


Layout = Replicate | Partial | Shard


def layout_to_json(layout: Layout) -> dict:
    if isinstance(layout, Shard):
        return {"shard": layout.dim, "blocks": layout.blocks}
    return {"replicate": True} if isinstance(layout, Replicate) else {"partial": True}


def layout_from_json(data: dict) -> Layout:
    if "shard" in data:
        return Shard(data["shard"], data.get("blocks", 1))
    return Replicate() if "replicate" in data else Partial()
