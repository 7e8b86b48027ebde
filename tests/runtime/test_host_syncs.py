"""No host syncs in gradient clipping and at most one in a loss-scaled mixed-precision step
(counted with nnscaler.runtime.dist.host_syncs on CPU), and clipping equals torch's clip_grad_norm_:
on 2 gloo ranks (dp 2, a hand-written ParallelModule) and in a plain process."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from nnscaler.runtime import build_optimizer
from nnscaler.runtime.dist.host_syncs import count_host_syncs
from nnscaler.runtime.grads.mixed_precision import DynamicLossScaler, MixedPrecisionAdamW

try:
    from .dist_util import run_dist
    from .test_module import BATCH, D, Gen, Ref
except ImportError:
    from dist_util import run_dist
    from test_module import BATCH, D, Gen, Ref

CLIP = 0.05


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_clip_gnorm_no_sync_and_parity() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 16), nn.GELU(), nn.Linear(16, D))
    ref = copy.deepcopy(model)
    x = torch.randn(BATCH, D)
    for m in (model, ref):
        m(x).square().mean().backward()
    opt = build_optimizer(model, torch.optim.SGD, lr=0.1)
    with count_host_syncs() as syncs:
        norm = opt.clip_gnorm(CLIP)  # type: ignore[attr-defined]
    want = nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
    assert syncs.count == 0, f"clip_gnorm read tensors on the host: {dict(syncs.sites)}"
    assert isinstance(norm, torch.Tensor) and norm.dim() == 0
    torch.testing.assert_close(norm, want, rtol=1e-6, atol=1e-7)
    for got, exp in zip(_grads(model), _grads(ref)):
        torch.testing.assert_close(got, exp, rtol=1e-6, atol=1e-7)


def _dp_worker(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    ref = Ref()
    full = {**ref.state_dict(), "freq": ref.freq}
    x, t = torch.randn(2 * BATCH, D), torch.randn(2 * BATCH, D)
    pm = Gen(rank, world, plan=1)
    pm.load_merged_state_dict(full)
    pm.to(torch.bfloat16)
    scaler = DynamicLossScaler(init_scale=2.0**8)
    opt = build_optimizer(pm, MixedPrecisionAdamW, lr=1e-3, loss_scaler=scaler)
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    loss = pm(x[mine].bfloat16(), t[mine].bfloat16())
    scaler.scale(loss).backward()
    with count_host_syncs() as clip:
        norm = opt.clip_gnorm(1e-3)  # type: ignore[attr-defined]
    with count_host_syncs() as step:
        opt.step()
    ref(x, t).backward()
    want = nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))
    return {
        "clip": (clip.count, dict(clip.sites)),
        "step": (step.count, dict(step.sites)),
        "norm": float(norm),
        "want": float(want),
        "skipped": opt.step_skipped if hasattr(opt, "step_skipped") else scaler.found_inf,
    }


def test_dp_clip_and_loss_scaled_step_syncs() -> None:
    for rank, res in enumerate(run_dist(_dp_worker, 2, timeout=60)):
        count, sites = res["clip"]
        assert count == 0, f"rank {rank}: clip_gnorm read tensors on the host: {sites}"
        count, sites = res["step"]
        assert count <= 1, f"rank {rank}: {count} host reads in one optimizer step (at most 1): {sites}"
        torch.testing.assert_close(res["norm"], res["want"], rtol=2e-2, atol=1e-3)
        assert not res["skipped"]


def _tp_worker(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from nnscaler.runtime.dist.groups import get_group, get_host_group

    torch.manual_seed(0)
    ref = Ref()
    pm = Gen(rank, world, plan=world)  # tensor parallel over both ranks: inputs checked every call
    pm.load_merged_state_dict({**ref.state_dict(), "freq": ref.freq})
    x, t = torch.randn(BATCH, D), torch.randn(BATCH, D)
    counts = []
    for _ in range(2):
        with count_host_syncs() as syncs:
            pm(x, t).backward()
        counts.append((syncs.count, syncs.host_only, dict(syncs.sites)))
    host = get_host_group([0, 1])
    assert host is not None and dist.get_backend(host) == "gloo"
    assert host is get_group([0, 1]), "under gloo the host twin is the plan group itself"
    return {"counts": counts}


def test_tp_forward_backward_has_no_device_syncs() -> None:
    """The per-call input-shape agreement check of a multi-rank plan reads its all-gathered digest on
    the host, over a gloo twin of the plan group: counted apart (host_only), never a device sync."""
    for rank, res in enumerate(run_dist(_tp_worker, 2)):
        for count, host_only, sites in res["counts"]:
            assert count == 0, f"rank {rank}: host reads in forward/backward: {sites}"
            assert host_only == 1, f"rank {rank}: expected the one shape-digest read, got {host_only}"
