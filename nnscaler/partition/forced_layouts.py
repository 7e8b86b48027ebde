"""Layouts a caller forces on stored parameters / buffers (tied weights across pipeline stages): checked
before partitioning, so a wrong name or an uneven split is a clear error rather than a bad shard."""

from __future__ import annotations

from nnscaler.errors import PartitionError
from nnscaler.graph.ir import Graph, Layout, Partial, Shard

__all__ = ["check_forced_layouts"]


def check_forced_layouts(graph: Graph, forced: dict[str, Layout], ways: int) -> dict[str, Layout]:
    """Forced storage layouts must name parameters/buffers of the graph and split them evenly."""
    for name, layout in forced.items():
        value = graph.values.get(name)
        if value is None or value.kind not in ("param", "buffer"):
            raise PartitionError(
                f"forced_layouts names {name!r}, which is not a parameter or buffer of the graph"
            )
        if isinstance(layout, Partial):
            raise PartitionError(
                f"forced_layouts[{name!r}] is Partial: a stored tensor must be Replicate or Shard"
            )
        if isinstance(layout, Shard) and not -len(value.meta.shape) <= layout.dim < len(value.meta.shape):
            raise PartitionError(
                f"forced_layouts[{name!r}] = {layout}: {name} has {len(value.meta.shape)} dims "
                f"(shape {tuple(value.meta.shape)}); choose one of them or Replicate()"
            )
        if isinstance(layout, Shard) and ways > 1:
            size = value.meta.shape[layout.dim]
            if size % (ways * layout.blocks):
                raise PartitionError(
                    f"forced_layouts[{name!r}] = {layout}: dim {layout.dim} of size {size} does not split into "
                    f"{ways} x {layout.blocks} equal pieces; choose another dim or Replicate()"
                )
    return dict(forced)
