"""Which global sequence positions each rank holds, and which (query, key) block pairs it computes.

A rank's local rows are a list of segments `(global start, length)`, concatenated in that order.
Layouts are pure data (tuples per group position), shared by the reorders, the ring and the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "Seg",
    "Layout",
    "BlockPair",
    "contiguous_chunks",
    "zigzag_chunks",
    "ring_layout",
    "block_pairs",
]

Seg = tuple[int, int]
"""(global start, length) of a run of consecutive sequence positions."""

Layout = tuple[tuple[Seg, ...], ...]
"""Per group position, the segments its local rows hold, in local order."""


def contiguous_chunks(n: int) -> list[list[int]]:
    """Fine chunks (2n of them, S/2n rows each) held by each of n ranks in the contiguous layout."""
    return [[2 * p, 2 * p + 1] for p in range(n)]


def zigzag_chunks(n: int, ulysses_size: int = 1) -> list[list[int]]:
    """Fine chunks (2n, S/2n rows each) each of n ranks holds before the hybrid's Ulysses step so
    that, after it, ring position i (inner group i) holds zigzag chunks i and 2R-1-i of 2R (R = n/U).

    Position p = i*U + j holds the j-th pair of the 2U fine chunks that make up those two chunks;
    with U = 1 this is plain zigzag: rank r holds fine chunks r and 2n-1-r.
    """
    u = ulysses_size
    r = n // u
    out = []
    for p in range(n):
        i, j = divmod(p, u)
        mine = list(range(i * u, (i + 1) * u)) + list(range((2 * r - 1 - i) * u, (2 * r - i) * u))
        out.append(mine[2 * j : 2 * j + 2])
    return out


def ring_layout(s: int, r: int, zigzag: bool) -> Layout:
    """Rows each of the r ring positions holds: contiguous S/r chunks, or zigzag chunks i, 2r-1-i."""
    if zigzag:
        c = s // (2 * r)
        return tuple(((i * c, c), ((2 * r - 1 - i) * c, c)) for i in range(r))
    c = s // r
    return tuple(((i * c, c),) for i in range(r))


@dataclass(frozen=True)
class BlockPair:
    """One query segment against the key segments of a K/V block that it can see."""

    q_local: Seg
    """(local row offset, length) of the query segment."""
    q_global: Seg
    kv_local: tuple[Seg, ...]
    """(local row offset in the K/V block, length) of each visible key segment."""
    kv_global: tuple[Seg, ...]
    causal: bool
    """Whether the causal mask cuts through this pair (False: every query row sees every key)."""


def _local_offsets(segs: tuple[Seg, ...]) -> list[int]:
    offsets, at = [], 0
    for _, length in segs:
        offsets.append(at)
        at += length
    return offsets


def block_pairs(q_segs: tuple[Seg, ...], kv_segs: tuple[Seg, ...], causal: bool) -> list[BlockPair]:
    """The pairs to compute for queries `q_segs` against a K/V block holding `kv_segs`.

    Causal: key segments wholly after a query segment are skipped, wholly before it are full, and
    overlapping ones take the causal mask. Query segments that see nothing are left out.
    """
    pairs = []
    kv_offsets = _local_offsets(kv_segs)
    for q_off, (q0, q_len) in zip(_local_offsets(q_segs), q_segs):
        local, glob, cut = [], [], False
        for k_off, (k0, k_len) in zip(kv_offsets, kv_segs):
            if causal and k0 > q0 + q_len - 1:
                continue  # every key after every query
            cut = cut or (causal and k0 + k_len - 1 > q0)
            local.append((k_off, k_len))
            glob.append((k0, k_len))
        if local:
            pairs.append(BlockPair((q_off, q_len), (q0, q_len), tuple(local), tuple(glob), cut))
    return pairs
