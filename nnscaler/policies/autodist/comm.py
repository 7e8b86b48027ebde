"""Alpha-beta times of collectives: time = steps * latency + bytes on the wire / bandwidth.

`nbytes` is always the size of the whole logical tensor: the all-reduced buffer, the gathered
output of an all-gather, the input of a reduce-scatter, one device's buffer of an all-to-all.
`p` devices take part over `link` (the group's bottleneck link, see ClusterSpec.link).
"""

from __future__ import annotations

import math

from nnscaler.policies.autodist.cluster import LinkSpec

__all__ = [
    "ring_all_reduce",
    "tree_all_reduce",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "send_recv",
    "COLLECTIVES",
]


def ring_all_reduce(nbytes: float, p: int, link: LinkSpec) -> float:
    """Ring: reduce-scatter then all-gather, 2(p-1) steps each moving nbytes/p."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (p - 1) * link.alpha + 2 * (p - 1) / p * nbytes / link.beta


def tree_all_reduce(nbytes: float, p: int, link: LinkSpec) -> float:
    """Double binary tree (pipelined): 2 log2(p) latency steps, each device sends the buffer twice."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    return 2 * math.ceil(math.log2(p)) * link.alpha + 2 * nbytes / link.beta


def all_reduce(nbytes: float, p: int, link: LinkSpec) -> float:
    """The faster of ring and tree (as NCCL picks by size)."""
    return min(ring_all_reduce(nbytes, p, link), tree_all_reduce(nbytes, p, link))


def all_gather(nbytes: float, p: int, link: LinkSpec) -> float:
    """Ring all-gather of a tensor of `nbytes` in total: (p-1) steps of nbytes/p."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    return (p - 1) * link.alpha + (p - 1) / p * nbytes / link.beta


def reduce_scatter(nbytes: float, p: int, link: LinkSpec) -> float:
    """Ring reduce-scatter of an `nbytes` input: the mirror of all-gather."""
    return all_gather(nbytes, p, link)


def all_to_all(nbytes: float, p: int, link: LinkSpec) -> float:
    """Pairwise all-to-all of an `nbytes` buffer per device: it keeps 1/p and sends the rest."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    return (p - 1) * link.alpha + (p - 1) / p * nbytes / link.beta


def send_recv(nbytes: float, p: int, link: LinkSpec) -> float:
    """One point-to-point message (`p` is ignored: it is there so every entry has one signature)."""
    if nbytes <= 0:
        return 0.0
    return link.alpha + nbytes / link.beta


COLLECTIVES = {
    "all_reduce": all_reduce,
    "ring_all_reduce": ring_all_reduce,
    "tree_all_reduce": tree_all_reduce,
    "all_gather": all_gather,
    "reduce_scatter": reduce_scatter,
    "all_to_all": all_to_all,
    "send_recv": send_recv,
}
"""Every collective by name."""
