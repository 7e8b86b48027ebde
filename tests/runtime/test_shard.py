"""shard_slice / assemble_shards / local_shape: pure, no process group."""

from __future__ import annotations

import pytest
import torch

from nnscaler.runtime import assemble_shards, shard_slice
from nnscaler.runtime.shard import local_shape


def test_strided_rows_example() -> None:
    full = torch.arange(192).unsqueeze(1).expand(192, 4)
    piece = shard_slice(full, (0, 1, 2, 3))
    want = torch.cat([torch.arange(32, 64), torch.arange(96, 128), torch.arange(160, 192)])
    assert torch.equal(piece[:, 0], want)
    assert local_shape((192, 4), (0, 1, 2, 3)) == (96, 4)


def test_plain_column_shard_is_a_view() -> None:
    full = torch.randn(6, 8)
    piece = shard_slice(full, (1, 3, 4, 1))
    assert torch.equal(piece, full[:, 6:8])
    assert piece.data_ptr() == full[:, 6:].data_ptr()
    assert shard_slice(full, None) is full


@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("ways,blocks", [(1, 1), (2, 1), (4, 1), (2, 3), (4, 3)])
def test_round_trip(dim: int, ways: int, blocks: int) -> None:
    full = torch.randn(24, 12, 36)
    pieces = {i: shard_slice(full, (dim, i, ways, blocks)).clone() for i in range(ways)}
    assert all(tuple(p.shape) == local_shape(full.shape, (dim, i, ways, blocks)) for i, p in pieces.items())
    assert torch.equal(assemble_shards(pieces, full.shape, dim, ways, blocks), full)
    # the pieces tile the tensor: every element appears in exactly one piece
    assert sum(p.numel() for p in pieces.values()) == full.numel()


def test_errors() -> None:
    with pytest.raises(ValueError, match="not divisible"):
        shard_slice(torch.randn(10, 4), (0, 0, 4, 1))
    with pytest.raises(ValueError, match="not divisible"):
        shard_slice(torch.randn(12, 4), (0, 0, 2, 4))
    with pytest.raises(ValueError, match="index"):
        shard_slice(torch.randn(12, 4), (0, 2, 2, 1))
    with pytest.raises(ValueError, match="out of range"):
        shard_slice(torch.randn(12, 4), (2, 0, 2, 1))
    with pytest.raises(ValueError, match="missing pieces"):
        assemble_shards({0: torch.randn(6, 4)}, (12, 4), 0, 2, 1)
    with pytest.raises(ValueError, match="shape"):
        assemble_shards({0: torch.randn(6, 4), 1: torch.randn(5, 4)}, (12, 4), 0, 2, 1)
