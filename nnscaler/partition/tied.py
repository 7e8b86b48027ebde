"""One storage layout for a weight that several pipeline stages use (a tied embedding and output head).

Each stage's tensor-parallel plan may want the weight in another layout (vocab-parallel embedding:
rows split, S(0); a head `x @ w.T` kept whole: R). Every stage then stores it in one shared layout
and converts it for its consumers (autograd-aware collectives), so the holders' gradients are shards
of the same piece: the tied-gradient all-reduce stays a plain sum, and each holder's state-dict
entry describes the same slice.
"""

from __future__ import annotations

from collections.abc import Sequence

from nnscaler.graph.ir import Layout, Shard
from nnscaler.partition.program import LocalTensor

__all__ = ["shared_layouts"]


def shared_layouts(stage_tensors: Sequence[Sequence[LocalTensor]]) -> dict[str, Layout]:
    """Name -> storage layout for each tensor that more than one stage holds in different layouts.

    The choice: the first sharded layout in stage order (a shard costs 1/tp of the memory and of the
    optimizer state), else the first stage's layout.
    """
    seen: dict[str, list[Layout]] = {}
    for tensors in stage_tensors:
        for t in tensors:
            seen.setdefault(t.name, []).append(t.layout)
    out = {}
    for name, layouts in seen.items():
        if len(set(map(str, layouts))) > 1:
            out[name] = next((lay for lay in layouts if isinstance(lay, Shard)), layouts[0])
    return out
