"""Hierarchical all-reduce (runtime/hierarchy.py): the node split, the cost rule, and on 4 gloo ranks
in 2 "nodes" of 2 ($NNSCALER_NODE_SIZE) gradients equal to single-device ones, with the async and the
synchronous reducer, with and without no_sync accumulation, and an optimizer step."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from nnscaler.config import ComputeConfig
from nnscaler.runtime import build_optimizer
from nnscaler.runtime.grads.hierarchy import (
    LATENCY_S,
    flat_ring_seconds,
    hierarchical_seconds,
    node_size,
    split_by_node,
    worth_it,
)

try:
    from .dist_util import run_dist
    from .test_module import LR, _setup
    from .test_reducer import TINY_MB, _gen, _grads_match, _params_match, _rows
except ImportError:
    from dist_util import run_dist
    from test_module import LR, _setup
    from test_reducer import TINY_MB, _gen, _grads_match, _params_match, _rows


def test_split_by_node() -> None:
    # data-parallel group [0..7] over nodes of 4: reduce-scatter in each node, all-reduce across
    assert split_by_node(list(range(8)), 4) == (
        [[0, 1, 2, 3], [4, 5, 6, 7]],
        [[0, 4], [1, 5], [2, 6], [3, 7]],
    )
    # a tp-2 plan's data-parallel group [1, 3, 5, 7] on nodes of 4: 2 ranks per node
    assert split_by_node([1, 3, 5, 7], 4) == ([[1, 3], [5, 7]], [[1, 5], [3, 7]])
    assert split_by_node([0, 1, 2, 3], 4) is None  # one node
    assert split_by_node([0, 4], 4) is None  # one rank per node: the flat ring is the hierarchy
    assert split_by_node([0, 1, 2, 4], 4) is None  # uneven


def test_node_size_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NNSCALER_NODE_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert node_size(16) == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert node_size(16) == 8
    monkeypatch.setenv("NNSCALER_NODE_SIZE", "3")
    with pytest.raises(
        ValueError, match="NNSCALER_NODE_SIZE=3 must be a positive divisor of the world size 16"
    ):
        node_size(16)


def test_cost_rule() -> None:
    mb25 = 25 * 2**20
    # 8 nodes of 8 GPUs, NVLink-class 300 GB/s inside, 50 GB/s NICs: 1/8 of the bytes cross nodes
    assert hierarchical_seconds(mb25, 8, 8, 300, 50) < 0.25 * flat_ring_seconds(mb25, 64, 50)
    assert worth_it(mb25, 8, 8, 300, 50)
    # links of one speed: each rank moves the same bytes either way; only the ring steps differ
    # (2 * 63 flat, 2 * 7 + 2 * 7 in two levels)
    diff = hierarchical_seconds(mb25, 8, 8, 50, 50) - flat_ring_seconds(mb25, 64, 50)
    assert diff == pytest.approx((28 - 126) * LATENCY_S, rel=1e-6)
    # small buckets over 2 x 2 ranks: not worth three collectives
    assert not worth_it(100, 2, 2, 10, 10)


def hierarchy_worker(rank: int, world: int) -> None:
    os.environ["NNSCALER_NODE_SIZE"] = "2"
    ref, full, x, t = _setup()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    rows = _rows(rank, world, 1)
    auto = _gen(rank, world, 1, ComputeConfig(1, world, reducer_bucket_cap_mb=TINY_MB), full)
    assert auto.reducer is not None and auto.reducer.hier is None, "tiny buckets: the flat ring (cost rule)"
    off = ComputeConfig(1, world, reducer_bucket_cap_mb=64.0, hierarchical_allreduce=False)
    assert _gen(rank, world, 1, off, full).reducer.hier is None
    big = ComputeConfig(1, world, reducer_bucket_cap_mb=64.0)
    assert _gen(rank, world, 1, big, full).reducer.hier is None, "links of one speed, 2 x 2: not worth it"
    os.environ.update(NNSCALER_INTRA_NODE_GBPS="100", NNSCALER_INTER_NODE_GBPS="10")
    assert _gen(rank, world, 1, big, full).reducer.hier is not None, "slow inter-node links: worth it"
    for async_op in (True, False):
        cfg = ComputeConfig(
            1, world, use_async_reducer=async_op, reducer_bucket_cap_mb=TINY_MB, hierarchical_allreduce=True
        )
        pm = _gen(rank, world, 1, cfg, full)
        ref.load_state_dict({k: v for k, v in full.items() if k != "freq"}, strict=False)
        red = pm.reducer
        assert red is not None and red.hier is not None and len(red.buckets) >= 4
        assert dist.get_process_group_ranks(red.hier.intra) == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert dist.get_process_group_ranks(red.hier.inter) == [rank % 2, rank % 2 + 2]
        what = f"hierarchical, async={async_op}"
        pm(x[rows], t[rows]).backward()
        ref(x, t).backward()
        pm.sync_grad()
        _grads_match(pm, ref, what)
        opt = build_optimizer(pm, torch.optim.SGD, lr=LR)
        opt.step()
        ref_opt.step()
        _params_match(pm, ref, f"{what}: parameters after a step")
        opt.zero_grad()
        ref_opt.zero_grad()
        # accumulation over two micro-batches, the first under no_sync
        for part in range(2):
            r = _rows(rank, world, 1, part, 2)
            if part == 0:
                with pm.no_sync():
                    pm(x[r], t[r]).backward()
            else:
                pm(x[r], t[r]).backward()
            everyone = torch.cat([_rows(q, world, 1, part, 2) for q in range(world)])
            ref(x[everyone], t[everyone]).backward()
        pm.sync_grad()
        _grads_match(pm, ref, f"{what}: accumulated")
        pm.zero_grad()
        ref.zero_grad()


@pytest.mark.timeout(120)
def test_hierarchical_allreduce_matches_single_device() -> None:
    run_dist(hierarchy_worker, 4, timeout=110)
