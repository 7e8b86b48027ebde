"""Which tensors a (parallel) module holds, on this rank and on every rank.

A `Held` is one tensor this rank holds a piece of: its names in the module's merged state dict (a
ParallelModule's original name and aliases under the module's prefix, or an outer tensor's own
name), its full shape and dtype, and which shard (`nnscaler.runtime.shard`) this rank keeps. The
`Layout` gathers every rank's `Held` metadata (small: names and shapes), so that every rank computes
the same missing / unexpected keys and the same export plan, and knows who sends which piece.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from nnscaler.runtime.device import is_initialized
from nnscaler.runtime.module import ParallelModule
from nnscaler.runtime.optimizer import parallel_modules
from nnscaler.runtime.shard import Shard

__all__ = ["Held", "TensorMeta", "Layout", "held_tensors", "gather_layout"]


@dataclass(frozen=True)
class TensorMeta:
    """Plain-data description of one tensor a rank holds (what `gather_layout` exchanges)."""

    names: tuple[str, ...]
    """Its names in the merged state dict: the canonical one first, then tied aliases."""
    full_shape: tuple[int, ...]
    dtype: str
    """`torch.dtype` name without the `torch.` prefix (picklable across versions)."""
    shard: Shard | None
    persistent: bool


@dataclass(frozen=True)
class Held:
    """A tensor this rank holds: its metadata and where it lives."""

    meta: TensorMeta
    pm: ParallelModule | None
    """The ParallelModule holding it (None: an outer tensor, replicated on every rank)."""
    local_name: str | None
    """Its attribute name in `pm` (None for an outer tensor)."""
    tensor: torch.Tensor | None
    """An outer tensor itself (None inside a ParallelModule: read it with `pm._tensor(local_name)`)."""

    @property
    def name(self) -> str:
        return self.meta.names[0]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def held_tensors(module: nn.Module) -> list[Held]:
    """Every tensor of `module` on this rank, ParallelModules' shards first, in registration order."""
    out: list[Held] = []
    inner: set[int] = set()
    for prefix, pm in parallel_modules(module):
        inner.update(id(t) for t in [*pm.parameters(), *pm.buffers()])
        for local, info in pm.fullmap.items():
            names = tuple(prefix + n for n in pm._names_of(info))
            meta = TensorMeta(names, info.full_shape, _dtype_name(info.dtype), info.shard, info.persistent)
            out.append(Held(meta, pm, local, None))
    skip = {
        f"{p}.{n}" if p else n
        for p, sub in module.named_modules()
        for n in getattr(sub, "_non_persistent_buffers_set", ())
    }
    by_tensor: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, t in [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]:
        if id(t) not in inner:
            by_tensor.setdefault(id(t), []).append(name)
            tensors[id(t)] = t
    for key, names in by_tensor.items():
        t = tensors[key]
        meta = TensorMeta(tuple(names), tuple(t.shape), _dtype_name(t.dtype), None, names[0] not in skip)
        out.append(Held(meta, None, None, t))
    return out


@dataclass
class Layout:
    """Every rank's tensors (metadata only), the same on every rank."""

    per_rank: list[list[TensorMeta]]
    by_name: dict[str, TensorMeta] = field(default_factory=dict)
    """Canonical name -> its metadata (the first rank's that holds it)."""
    alias: dict[str, str] = field(default_factory=dict)
    """Every name (aliases included) -> the canonical name."""

    pieces: dict[str, dict[Shard | None, int]] = field(default_factory=dict)
    """Canonical name -> each distinct piece of it -> the lowest rank holding it (its sender on export)."""

    def __post_init__(self) -> None:
        for rank, metas in enumerate(self.per_rank):
            for m in metas:
                known = next((self.alias[n] for n in m.names if n in self.alias), None)
                canonical = known if known is not None else m.names[0]
                if known is None:
                    self.by_name[canonical] = m
                for n in m.names:
                    self.alias.setdefault(n, canonical)
                self.pieces.setdefault(canonical, {}).setdefault(m.shard, rank)


def gather_layout(held: Sequence[Held]) -> Layout:
    """All ranks' tensor metadata (a collective over the default group when one exists)."""
    mine = [h.meta for h in held]
    if not is_initialized() or dist.get_world_size() == 1:
        return Layout([mine])
    box: list[list[TensorMeta] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(box, mine)
    return Layout([b or [] for b in box])
