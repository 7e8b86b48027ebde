"""Hierarchical all-reduce for data parallelism across nodes (BytePS's idea): reduce-scatter inside
each node, all-reduce each slice across nodes, all-gather inside the node. Only 1/g of the bytes
(g: data-parallel ranks per node) crosses the slow inter-node links, at the price of two passes over
the fast intra-node ones.

A node is `$NNSCALER_NODE_SIZE` consecutive global ranks, else `$LOCAL_WORLD_SIZE` (set by torchrun),
else the whole world (one node: nothing to do). `ComputeConfig.hierarchical_allreduce` chooses: True
uses it wherever the data-parallel group spans several nodes with the same number (> 1) of its ranks
on each; False never; None (default) when the alpha-beta cost of one gradient bucket says it is
faster than one flat ring by `MARGIN`, with link bandwidths from `$NNSCALER_INTRA_NODE_GBPS` and
`$NNSCALER_INTER_NODE_GBPS` (GB/s per rank; defaults: NVLink-class 300 and a 400 Gb/s NIC, 50, on
CUDA; equal on CPU, where the flat ring wins).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nnscaler import env_vars
from nnscaler.errors import ConfigError
from nnscaler.mesh import ParallelDims
from nnscaler.runtime.dist.groups import create_groups, get_group

__all__ = [
    "Hierarchy",
    "node_size",
    "split_by_node",
    "flat_ring_seconds",
    "hierarchical_seconds",
    "worth_it",
    "build_hierarchy",
]

LATENCY_S = 10e-6
"""Per-step latency of a ring collective (alpha)."""


@dataclass(frozen=True)
class Hierarchy:
    """The two communicators of one rank's hierarchical all-reduce."""

    intra: dist.ProcessGroup
    """This rank's data-parallel peers on its node (reduce-scatter, then all-gather)."""
    inter: dist.ProcessGroup
    """The data-parallel ranks holding the same slice on the other nodes (all-reduce of the slice)."""
    intra_size: int
    inter_size: int


def node_size(world_size: int) -> int:
    """Ranks per node: $NNSCALER_NODE_SIZE, else $LOCAL_WORLD_SIZE (torchrun), else `world_size`."""
    for var in ("NNSCALER_NODE_SIZE", "LOCAL_WORLD_SIZE"):
        size = env_vars.read(var)  # a positive int, else ConfigError
        if size:
            if world_size % size:
                raise ConfigError(
                    f"environment variable {var}={size} must be a positive divisor of the world size {world_size}: "
                    "set it to the ranks per node, or unset it"
                )
            return size
    return world_size


def split_by_node(dp_ranks: list[int], per_node: int) -> tuple[list[list[int]], list[list[int]]] | None:
    """(intra groups, inter groups) of one data-parallel group, or None when it does not span several
    nodes with the same number (> 1) of its ranks on each."""
    nodes: dict[int, list[int]] = {}
    for r in dp_ranks:
        nodes.setdefault(r // per_node, []).append(r)
    sizes = {len(v) for v in nodes.values()}
    if len(nodes) < 2 or len(sizes) != 1 or sizes.pop() < 2:
        return None
    intra = list(nodes.values())
    inter = [[group[j] for group in intra] for j in range(len(intra[0]))]
    return intra, inter


def flat_ring_seconds(nbytes: float, n: int, bottleneck_gbps: float) -> float:
    """One ring all-reduce of `nbytes` over `n` ranks whose slowest link carries `bottleneck_gbps`."""
    return 2 * (n - 1) * (LATENCY_S + nbytes / n / (bottleneck_gbps * 1e9))


def hierarchical_seconds(nbytes: float, g: int, m: int, intra_gbps: float, inter_gbps: float) -> float:
    """Reduce-scatter and all-gather over `g` ranks per node, all-reduce of 1/g over `m` nodes."""
    inside = 2 * (g - 1) * (LATENCY_S + nbytes / g / (intra_gbps * 1e9))
    across = 2 * (m - 1) * (LATENCY_S + nbytes / g / m / (inter_gbps * 1e9))
    return inside + across


MARGIN = 1.5
"""`auto` takes the hierarchy only when the model predicts it this many times faster: the model does
not price the extra synchronisation points of three collectives on two communicators."""


def worth_it(nbytes: float, g: int, m: int, intra_gbps: float, inter_gbps: float) -> bool:
    """The cost rule of `hierarchical_allreduce=None` for one bucket of `nbytes` (g ranks per node, m nodes)."""
    flat = flat_ring_seconds(nbytes, g * m, min(intra_gbps, inter_gbps))
    return hierarchical_seconds(nbytes, g, m, intra_gbps, inter_gbps) * MARGIN < flat


def _bandwidths() -> tuple[float, float]:
    cuda = torch.cuda.is_available()
    intra = env_vars.read("NNSCALER_INTRA_NODE_GBPS") or (300.0 if cuda else 10.0)
    inter = env_vars.read("NNSCALER_INTER_NODE_GBPS") or (50.0 if cuda else 10.0)
    return intra, inter


def build_hierarchy(
    rank: int, world_size: int, plan_ngpus: int, config: Any, bucket_bytes: float
) -> Hierarchy | None:
    """This rank's `Hierarchy` when its data-parallel group is reduced hierarchically, else None.
    Collective: creates the intra- and inter-node groups of every data-parallel group."""
    choice = getattr(config, "hierarchical_allreduce", None) if config is not None else None
    if choice is False or not dist.is_initialized():
        return None
    per_node = node_size(world_size)
    splits = [split_by_node(dp, per_node) for dp in ParallelDims(plan_ngpus, world_size).dp_groups()]
    if any(s is None for s in splits):  # every data-parallel group alike (they mirror each other)
        return None
    intra_all = [g for s in splits if s is not None for g in s[0]]
    inter_all = [g for s in splits if s is not None for g in s[1]]
    g, m = len(intra_all[0]), len(inter_all[0])
    if choice is None and not worth_it(bucket_bytes, g, m, *_bandwidths()):
        return None
    create_groups(intra_all + inter_all)
    intra = get_group(next(x for x in intra_all if rank in x))
    inter = get_group(next(x for x in inter_all if rank in x))
    assert intra is not None and inter is not None
    return Hierarchy(intra, inter, g, m)
