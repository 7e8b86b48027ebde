"""Bucketing of gradients (pure; the all-reduce itself is tested on 4 ranks in test_module.py)."""

from __future__ import annotations

import torch

from nnscaler.runtime.reducer import average_gradients, make_buckets


def test_buckets_respect_cap_dtype_and_order() -> None:
    params = [
        torch.zeros(n, dtype=d)
        for n, d in [
            (10, torch.float32),
            (20, torch.float32),
            (5, torch.bfloat16),
            (30, torch.float32),
            (100, torch.float32),
        ]
    ]
    buckets = make_buckets(params, cap_mb=128 / 2**20)  # 128 bytes: 32 float32s
    assert [[p.numel() for p in b] for b in buckets] == [[10, 20], [30], [100], [5]]
    assert all(len({p.dtype for p in b}) == 1 for b in buckets)
    assert [[p.numel() for p in b] for b in make_buckets(params, cap_mb=None)] == [[10, 20, 30, 100], [5]]
    assert len(make_buckets(params, cap_mb=0)) == len(params)


def test_no_group_leaves_gradients_alone() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    average_gradients([p], None)
    assert torch.equal(p.grad, torch.full((3,), 2.0))
