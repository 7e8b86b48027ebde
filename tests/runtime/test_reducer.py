"""The gradient reducer: bucketing (pure), and on 2 and 4 gloo ranks the overlapping (async) reducer
with many tiny buckets against the synchronous one and against single-device training, including
gradient accumulation with and without `no_sync`."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from nnscaler.config import ComputeConfig
from nnscaler.runtime import build_optimizer
from nnscaler.runtime.grads.reducer import average_gradients, make_buckets, zero_groups
from nnscaler.runtime.shard import shard_slice

try:
    from .dist_util import run_dist
    from .test_module import BATCH, LR, Gen, Ref, _close, _setup
except ImportError:
    from dist_util import run_dist
    from test_module import BATCH, LR, Gen, Ref, _close, _setup

TINY_MB = 1e-4  # ~26 floats a bucket: the small test model spreads over many buckets


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


def test_zero_groups_follow_nnscaler() -> None:
    assert zero_groups([0, 2, 4, 6], 2) == ([[0, 2], [4, 6]], [[0, 4], [2, 6]])
    assert zero_groups([0, 1, 2, 3], 1) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])
    with pytest.raises(ValueError, match="zero_ngroups=3"):
        zero_groups([0, 1, 2, 3], 3)


def _gen(rank: int, world: int, plan: int, cfg: ComputeConfig, full: dict[str, torch.Tensor]) -> Gen:
    pm = Gen(rank, world, plan, init_params=False)
    pm.compute_config = cfg
    pm.load_merged_state_dict(full)
    return pm


def _grads_match(pm: Gen, ref: nn.Module, what: str) -> None:
    named = dict(ref.named_parameters())
    for local, info in pm.fullmap.items():
        if info.is_param:
            want = shard_slice(named[info.original_name].grad, info.shard)
            _close(getattr(pm, local).grad, want, f"{what}: gradient of {info.original_name}")


def _params_match(pm: Gen, ref: nn.Module, what: str) -> None:
    full = ref.state_dict()
    for local, info in pm.fullmap.items():
        if info.is_param:
            _close(getattr(pm, local).detach(), shard_slice(full[info.original_name], info.shard), what)


def _rows(rank: int, world: int, plan: int, part: int = 0, parts: int = 1) -> torch.Tensor:
    """Batch rows of this rank's data-parallel replica (micro-batch `part` of `parts`)."""
    ndp, d = world // plan, rank // plan
    per = BATCH // ndp // parts
    return torch.arange(d * BATCH // ndp + part * per, d * BATCH // ndp + (part + 1) * per)


def async_worker(rank: int, world: int, plan: int) -> None:
    ref, full, x, t = _setup()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
    pm = _gen(
        rank,
        world,
        plan,
        ComputeConfig(plan, world, use_async_reducer=True, reducer_bucket_cap_mb=TINY_MB),
        full,
    )
    sync_pm = _gen(
        rank,
        world,
        plan,
        ComputeConfig(plan, world, use_async_reducer=False, reducer_bucket_cap_mb=TINY_MB),
        full,
    )
    opt = build_optimizer(pm, torch.optim.AdamW, lr=LR, weight_decay=0.1)
    rows = _rows(rank, world, plan)
    for step in range(3):
        sync_pm.load_state_dict(pm.state_dict())
        pm(x[rows], t[rows]).backward()
        red = pm.reducer
        assert red is not None and red.async_op and len(red.buckets) >= 5, "expected many buckets"
        assert all(b.reduced for b in red.buckets), "every bucket is launched during backward"
        # as torch DDP: the end of backward waits for the reductions and `.grad` is the averaged
        # gradient, a view of its bucket (no sync_grad needed before reading it)
        for bucket in red.buckets:
            for p, view in zip(bucket.params, bucket.views):
                assert p.grad is not None and p.grad.data_ptr() == view.data_ptr(), "grad is its bucket view"
        ref(x, t).backward()
        _grads_match(pm, ref, f"step {step}, right after backward")
        sync_pm(x[rows], t[rows]).backward()
        pm.sync_grad()
        sync_pm.sync_grad()
        for (name, a), b in zip(pm.named_parameters(), sync_pm.parameters()):
            assert torch.equal(a.grad, b.grad), f"async != sync for {name} at step {step}"
        _grads_match(pm, ref, f"step {step}")
        if step == 1:
            ref_norm = float(nn.utils.clip_grad_norm_(ref.parameters(), 0.05))
            _close(float(opt.clip_gnorm(0.05)), ref_norm, "clip_gnorm")  # type: ignore[attr-defined]
        opt.step()
        opt.zero_grad()
        sync_pm.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        _params_match(pm, ref, f"parameters after step {step}")

    # gradient accumulation over 2 micro-batches: with no_sync (one reduction), and without it (the
    # second backward finds its buckets reduced already and reduces them again: still the average)
    for use_no_sync in (True, False):
        pm.zero_grad()
        ref.zero_grad()
        for part in range(2):
            r = _rows(rank, world, plan, part, 2)
            if use_no_sync and part == 0:
                with pm.no_sync():
                    pm(x[r], t[r]).backward()
                assert not any(b.reduced for b in pm.reducer.buckets)
            else:
                pm(x[r], t[r]).backward()
            everyone = torch.cat([_rows(q, world, plan, part, 2) for q in range(0, world, plan)])
            ref(x[everyone], t[everyone]).backward()
        pm.sync_grad()
        _grads_match(pm, ref, f"accumulated gradients (no_sync={use_no_sync})")
    # a plain optimizer's zero_grad (set_to_none) after a sync must not leak old gradients
    pm.zero_grad()
    ref.zero_grad()
    for module in (pm, ref):
        for p in module.parameters():
            p.grad = None
    pm(x[rows], t[rows]).backward()
    ref(x, t).backward()
    pm.sync_grad()
    _grads_match(pm, ref, "after zero_grad")
    for p in pm.parameters():
        p.grad = None  # what torch.optim.Optimizer.zero_grad does
    ref.zero_grad()
    pm(x[rows], t[rows]).backward()
    ref(x, t).backward()
    pm.sync_grad()
    _grads_match(pm, ref, "after clearing .grad by hand")
    group = pm.group("dp")
    assert group is not None and dist.get_world_size(group) == world // plan


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,plan", [(2, 1), (4, 2)])
def test_async_reducer_matches_sync_and_single_device(world: int, plan: int) -> None:
    run_dist(async_worker, world, plan, timeout=110)


def _unused(ref: Any) -> None:  # keep Ref imported for readers: the single-device model compared against
    del ref


_unused(Ref)


def bucket_view_worker(rank: int, world: int) -> None:
    """zero_grad(set_to_none=False): `.grad` stays its bucket's view and backward accumulates into it in
    place, with no copy into the bucket; the gradients still average like single-device ones."""
    from nnscaler.runtime.grads import buckets

    ref, full, x, t = _setup()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    pm = _gen(rank, world, 1, ComputeConfig(1, world, reducer_bucket_cap_mb=TINY_MB), full)
    opt = build_optimizer(pm, torch.optim.SGD, lr=LR)
    copies = []
    copy_in = buckets.Bucket._copy_in
    buckets.Bucket._copy_in = lambda self, view, grad: (copies.append(1), copy_in(self, view, grad))[1]
    rows = _rows(rank, world, 1)
    for step in range(3):
        copies.clear()
        pm(x[rows], t[rows]).backward()
        ref(x, t).backward()
        red = pm.reducer
        for bucket in red.buckets:
            for p, view in zip(bucket.params, bucket.views):
                assert p.grad.data_ptr() == view.data_ptr(), f"step {step}: grad is not its bucket view"
        if step > 0:
            assert not copies, f"step {step}: {len(copies)} gradients copied into buckets"
        _grads_match(pm, ref, f"bucket views, step {step}")
        opt.step()
        ref_opt.step()
        pm.zero_grad(set_to_none=False)
        ref_opt.zero_grad()
        _params_match(pm, ref, f"bucket views, parameters after step {step}")
    assert copies == [] and all(bool((p.grad == 0).all()) for p in pm.parameters())


def test_zero_grad_keeping_bucket_views() -> None:
    run_dist(bucket_view_worker, 2)
