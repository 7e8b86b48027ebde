"""Pure helpers for sharded tensors: which slice of a full tensor a rank holds, and how to rebuild it.

A shard is `(dim, index, ways, blocks)`: the rank holds piece `index` of `ways` along `dim`. With
`blocks > 1` the dim is first viewed as `blocks` equal contiguous blocks (e.g. fused q, k, v rows) and
the rank holds piece `index` of every block, concatenated in block order (a strided shard).
`None` means replicated: the rank holds the whole tensor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

__all__ = ["Shard", "normalize_shard", "shard_slice", "local_shape", "assemble_shards"]

Shard = tuple[int, int, int, int]
"""`(dim, index, ways, blocks)`."""


def normalize_shard(shard: Sequence[int] | None, ndim: int) -> Shard | None:
    """Validate a shard spec for a tensor of `ndim` dims; return it as a tuple with a non-negative dim.

    Shards with `ways == 1` and `blocks == 1` are the whole tensor and normalize to `None`.
    """
    if shard is None:
        return None
    if len(shard) != 4:
        raise ValueError(f"shard must be (dim, index, ways, blocks), got {shard!r}")
    dim, index, ways, blocks = (int(v) for v in shard)
    if not -ndim <= dim < ndim:
        raise ValueError(f"shard {shard!r}: dim {dim} out of range for a {ndim}-d tensor")
    if ways < 1 or blocks < 1 or not 0 <= index < ways:
        raise ValueError(f"shard {shard!r}: need ways >= 1, blocks >= 1 and 0 <= index < ways")
    if ways == 1:
        return None
    return (dim % ndim, index, ways, blocks)


def _check_divisible(size: int, shard: Shard) -> int:
    dim, _, ways, blocks = shard
    if size % (ways * blocks) != 0:
        raise ValueError(f"shard {shard!r}: dim {dim} of size {size} is not divisible by ways*blocks")
    return size // (ways * blocks)


def local_shape(full_shape: Sequence[int], shard: Sequence[int] | None) -> tuple[int, ...]:
    """Shape of the piece a rank holds of a tensor of `full_shape`."""
    shape = tuple(int(s) for s in full_shape)
    norm = normalize_shard(shard, len(shape))
    if norm is None:
        return shape
    dim, _, ways, _ = norm
    _check_divisible(shape[dim], norm)
    return shape[:dim] + (shape[dim] // ways,) + shape[dim + 1 :]


def shard_slice(full: torch.Tensor, shard: Sequence[int] | None) -> torch.Tensor:
    """This shard's piece of `full` (a view when `blocks == 1`, else a copy); `None` returns `full`."""
    norm = normalize_shard(shard, full.dim())
    if norm is None:
        return full
    dim, index, ways, blocks = norm
    chunk = _check_divisible(full.shape[dim], norm)
    if blocks == 1:
        return full.narrow(dim, index * chunk, chunk)
    shape = tuple(full.shape)
    blocked = full.reshape(shape[:dim] + (blocks, shape[dim] // blocks) + shape[dim + 1 :])
    piece = blocked.narrow(dim + 1, index * chunk, chunk)
    return piece.reshape(shape[:dim] + (blocks * chunk,) + shape[dim + 1 :])


def assemble_shards(
    pieces: Mapping[int, torch.Tensor], full_shape: Sequence[int], dim: int, ways: int, blocks: int = 1
) -> torch.Tensor:
    """Inverse of `shard_slice`: rebuild the full tensor from the pieces `{index: piece}` of all `ways`."""
    shape = tuple(int(s) for s in full_shape)
    norm = normalize_shard((dim, 0, ways, blocks), len(shape))
    if norm is None:
        return pieces[0]
    dim = norm[0]
    missing = sorted(set(range(ways)) - set(pieces))
    if missing:
        raise ValueError(f"cannot assemble a tensor of shape {shape}: missing pieces {missing} of {ways}")
    chunk = _check_divisible(shape[dim], norm)
    ordered = [pieces[i] for i in range(ways)]
    want = shape[:dim] + (blocks * chunk,) + shape[dim + 1 :]
    for i, piece in enumerate(ordered):
        if tuple(piece.shape) != want:
            raise ValueError(f"piece {i} has shape {tuple(piece.shape)}, expected {want} for full {shape}")
    if blocks == 1:
        return torch.cat(ordered, dim=dim)
    split = [p.reshape(shape[:dim] + (blocks, chunk) + shape[dim + 1 :]) for p in ordered]
    return torch.cat(split, dim=dim + 1).reshape(shape)
