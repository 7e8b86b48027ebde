"""The composition every kind runs: (zigzag reorder) -> (Ulysses over inner groups) -> (ring over
ring groups, or local attention) -> back.

The attention's group (N ranks, sorted) is split into N/U inner groups of U consecutive positions
(Ulysses) and U ring groups of the positions with the same index inside their inner group.
- "ring": U = 1, contiguous ring; "zigzag": U = 1, zigzag ring when causal;
- "ulysses": U = N, no ring; "hybrid": 1 <= U <= N, zigzag ring when causal.
Rows: inputs arrive contiguous (position p: rows [p*S/N, (p+1)*S/N)). With the zigzag ring the
reorder first gives position i*U + j the j-th pair of the 2U fine chunks (S/2N rows) of zigzag
chunks i and 2R-1-i (of 2R, R = N/U), so that after Ulysses inner group i holds exactly those two
chunks, in that order: the ring's layout (`layout.ring_layout`). Without it inner group i holds
rows [i*S/R, (i+1)*S/R).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nnscaler.runtime.context_parallel.layout import ring_layout
from nnscaler.runtime.context_parallel.ring import RingSpec, ring_attention
from nnscaler.runtime.context_parallel.ulysses import gather_heads, local_attention, scatter_heads
from nnscaler.runtime.context_parallel.zigzag import from_zigzag, to_zigzag
from nnscaler.runtime.dist.groups import get_group

__all__ = ["HybridPlan", "hybrid_subgroups", "hybrid_attention"]


def hybrid_subgroups(group_ranks: list[int], ulysses_size: int) -> list[list[int]]:
    """Every inner (Ulysses) group and every ring group, as global ranks, of a hybrid over
    `group_ranks` (sorted first); create them on every rank before the first call."""
    ranks = sorted(group_ranks)
    n, u = len(ranks), ulysses_size
    if u < 1 or n % u != 0:
        raise ValueError(f"ulysses_size={u} must divide the context-parallel group size {n}")
    inner = [ranks[i * u : (i + 1) * u] for i in range(n // u)]
    rings = [ranks[j::u] for j in range(u)]
    return inner + rings


@dataclass(frozen=True)
class HybridPlan:
    """How one call runs (see the module docstring)."""

    ulysses_size: int
    zigzag: bool
    """Whether the ring is the zigzag one (causal only)."""


def _subgroups(group: Any, u: int) -> tuple[Any, Any]:
    """(inner group, ring group) of this rank; the group itself where it is the whole of one."""
    n = dist.get_world_size(group)
    if u == 1:
        return None, group
    if u == n:
        return group, None
    ranks = sorted(dist.get_process_group_ranks(group))
    pos = dist.get_rank(group)
    i, j = divmod(pos, u)
    return get_group(ranks[i * u : (i + 1) * u]), get_group(ranks[j::u])


def hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    causal: bool,
    scale: float,
    group: Any,
    plan: HybridPlan,
) -> torch.Tensor:
    """This rank's output rows (contiguous layout) of attention over the whole group's sequence."""
    n, u = dist.get_world_size(group), plan.ulysses_size
    r = n // u
    inner, ring = _subgroups(group, u)
    zigzag = plan.zigzag and causal and r > 1
    if zigzag:
        q, k, v, mask = to_zigzag(q, k, v, mask, group, u)
    if inner is not None:
        q, k, v, mask = scatter_heads(q, k, v, mask, inner)
    if ring is not None:
        s = q.shape[-2] * r
        gqa = q.shape[-3] // k.shape[-3]
        spec = RingSpec(ring, ring_layout(s, r, zigzag), causal, scale, gqa)
        out = ring_attention(q, k, v, mask, spec)
    else:
        out = local_attention(q, k, v, mask, causal, scale)
    if inner is not None:
        out = gather_heads(out, inner)
    if zigzag:
        out = from_zigzag(out, group, u)
    return out
