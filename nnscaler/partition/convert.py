"""Communication between layouts: the collective that turns a producer's layout into a consumer's."""

from __future__ import annotations

from dataclasses import dataclass

from nnscaler.errors import PartitionError
from nnscaler.graph.ir import Layout, Partial, Replicate, Shard

__all__ = ["GROUP", "CommStep", "conversion_steps"]


@dataclass(frozen=True)
class _Group:
    """Stands for the tensor-parallel process group in a statement's args."""

    def __repr__(self) -> str:
        return "GROUP"


GROUP = _Group()


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


def conversion_steps(src: Layout, dst: Layout) -> list[CommStep]:
    """The cheapest sequence of collectives from src to dst (empty when they are equal)."""
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
        return conversion_steps(src, Replicate()) + conversion_steps(Replicate(), dst)
    raise PartitionError(f"no communication turns layout {src} into {dst}")
