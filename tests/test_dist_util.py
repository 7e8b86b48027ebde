"""The spawn helper: results come back by rank, failures and hangs fail fast with the story."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.dist_util import SpawnError, spawn


def _sum_ranks(rank: int, world_size: int, offset: int) -> dict:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "world": world_size, "sum": t.item() + offset}


def _fail_on_rank1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 is broken on purpose")
    dist.barrier()  # rank 0 waits for a peer that never comes


def _hang_on_rank1(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(600)
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, 4])
def test_spawn_returns_results_by_rank(world_size: int, tmp_path) -> None:
    results = spawn(_sum_ranks, world_size, tmp_path, 10)
    expected = sum(range(world_size)) + 10
    assert results == [{"rank": r, "world": world_size, "sum": expected} for r in range(world_size)]


def test_spawn_surfaces_child_traceback(tmp_path) -> None:
    start = time.monotonic()
    with pytest.raises(
        SpawnError, match="first: rank 1 raised ValueError: rank 1 is broken on purpose"
    ) as info:
        spawn(_fail_on_rank1, 2, tmp_path, timeout=120)
    assert "Traceback" in str(info.value) and "_fail_on_rank1" in str(info.value)
    assert time.monotonic() - start < 60, "a failed rank must not make the others wait for the timeout"


def test_spawn_times_out_instead_of_hanging(tmp_path) -> None:
    start = time.monotonic()
    with pytest.raises(SpawnError, match="did not finish within 15 s") as info:
        spawn(_hang_on_rank1, 2, tmp_path, timeout=15)
    assert "_hang_on_rank1" in str(info.value), "the hung ranks' Python stacks belong in the message"
    assert time.monotonic() - start < 60
