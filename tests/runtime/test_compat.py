"""nnScaler 0.8's API on our runtime (2 gloo ranks, data parallel): sync_grad_when accumulates like
no_sync, clip_gnorm returns (norm, grads), the reducers / parameters_for_* members, broadcast_weights'
stride_size, the loaders' device= keyword, and the per-rank checkpoint files merged into one."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

import nnscaler
from nnscaler.config import ComputeConfig
from nnscaler.runtime import build_optimizer
from nnscaler.runtime.module import ParallelModule

try:
    from .dist_util import run_dist
    from .test_module import LR, _setup
    from .test_reducer import TINY_MB, _gen, _grads_match, _rows
except ImportError:
    from dist_util import run_dist
    from test_module import LR, _setup
    from test_reducer import TINY_MB, _gen, _grads_match, _rows


def compat_worker(rank: int, world: int, tmp: str) -> None:
    ref, full, x, t = _setup()
    pm = _gen(rank, world, 1, ComputeConfig(1, world, reducer_bucket_cap_mb=TINY_MB), full)
    opt = build_optimizer(pm, torch.optim.SGD, ComputeConfig(1, world, reducer_bucket_cap_mb=TINY_MB), lr=LR)
    # sync_grad_when: the first micro-batch accumulates locally, the second reduces the sum
    for part in range(2):
        r = _rows(rank, world, 1, part, 2)
        with nnscaler.sync_grad_when(part == 1):
            pm(x[r], t[r]).backward()
        if part == 0:
            assert not any(b.reduced for b in pm.reducer.buckets), "sync_grad_when(False) launched reductions"
        everyone = torch.cat([_rows(q, world, 1, part, 2) for q in range(world)])
        ref(x[everyone], t[everyone]).backward()
    pm.sync_grad()
    _grads_match(pm, ref, "sync_grad_when")
    norm, grads = pm.clip_gnorm(None)
    want = nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))
    torch.testing.assert_close(norm, want, rtol=1e-5, atol=1e-6)
    assert len(grads) == len(list(pm.parameters())) and all(isinstance(g, torch.Tensor) for g in grads)
    assert pm.reducers == [pm.reducer] and pm.parameters_for_broadcast() == list(pm.parameters())
    infos = pm.parameters_for_calc_gnorm()
    assert len(infos) == 1 and infos[0].ranks == (0, 1) and infos[0].zero_ngroups == 1
    opt.step()
    # broadcast_weights: nnScaler's stride_size, checked against the plan
    nnscaler.broadcast_weights(pm, 1)
    with pytest.raises(ValueError, match="stride_size=2.*plan_ngpus=1"):
        nnscaler.broadcast_weights(pm, 2)
    # the loaders take nnScaler's parameter names and device=
    sd, opt_sd = pm.state_dict(), opt.state_dict()
    nnscaler.load_sharded_state_dict(
        pm, module_state_dict=sd, optimizer=opt, optimizer_state_dict=opt_sd, device="cpu"
    )
    # nnScaler's per-rank checkpoint files, merged into the single-device state
    prefix = os.path.join(tmp, "ckpt")
    path = pm.save_checkpoint(opt, prefix)
    assert path == f"{prefix}-{rank}.ckpt" and os.path.exists(path)
    torch.distributed.barrier()
    if rank == 0:
        merged = torch.load(ParallelModule.merge_checkpoints(prefix), weights_only=True)
        assert set(ref.state_dict()) <= set(merged["state_dict"])
        for name, value in sd.items():  # plan_ngpus 1: each rank holds whole tensors
            if name in merged["state_dict"] and isinstance(value, torch.Tensor):
                assert torch.equal(merged["state_dict"][name], value), name
        assert merged["optim_state_dict"] is not None


def test_nnscaler_api_on_two_ranks(tmp_path: Any) -> None:
    run_dist(compat_worker, 2, str(tmp_path))


def test_markers_and_register_op_arguments() -> None:
    with pytest.warns(UserWarning, match="pipeline_pivots"):
        nnscaler.anchor("stage-boundary")
    with nnscaler.constant_folding(), nnscaler.no_constant_folding():
        assert nnscaler.fold_constant(3) == 3
    with pytest.raises(TypeError, match="emit_fn must be callable"):
        nnscaler.register_op("* h -> * h", emit_fn="not a function")
    with pytest.raises(TypeError, match="annotation must be a string"):
        nnscaler.register_op(lambda *a: "* h -> * h")


def summed_worker(rank: int, world: int) -> None:
    """dp_grad_reduction='sum' (nnScaler's convention): the replicas' gradients add up, with the
    plain reducer, ZeRO 1 and ZeRO 3; 'mean' (ours, the default) is that sum over the replica count."""
    from nnscaler.runtime.grads.reducer import param_grad

    ref, full, x, t = _setup()
    rows = _rows(rank, world, 1)
    ref(x, t).backward()  # the mean over the whole batch = the mean of the replicas' means
    for extra in ({}, {"use_zero": True}, {"use_zero": True, "zero_stage": 3}):
        pm = _gen(rank, world, 1, ComputeConfig(1, world, dp_grad_reduction="sum", **extra), full)
        pm(x[rows], t[rows]).backward()
        pm.sync_grad()
        if not extra:
            scaled = {n: p.grad * world for n, p in ref.named_parameters() if p.grad is not None}
            for local, info in pm.fullmap.items():
                if info.is_param and info.original_name in scaled:
                    torch.testing.assert_close(param_grad(getattr(pm, local)), scaled[info.original_name])
        norm = pm.clip_gnorm(None)[0]
        want = nn.utils.clip_grad_norm_(ref.parameters(), float("inf")) * world
        torch.testing.assert_close(norm, want, rtol=1e-5, atol=1e-6, msg=f"{extra}: summed gradient norm")


def test_dp_grad_reduction_sum() -> None:
    run_dist(summed_worker, 2)
    with pytest.raises(Exception, match="dp_grad_reduction must be 'mean' or 'sum'"):
        ComputeConfig(1, 2, dp_grad_reduction="avg")
