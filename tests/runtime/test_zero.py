"""ZeRO stages 1 and 2 on 4 gloo ranks: training equals single-device AdamW for zero_ngroups 1 and 2,
with all-reduce or reduce-scatter, sync or async reducer, pure data parallel and tp 2 x dp 2; the
merged optimizer state equals the single-device one; checkpoints load back; per rank, Adam's fp32
state takes 8Ψ/N bytes and the gradients 4Ψ (stage 1) or 4Ψ/N (stage 2)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nnscaler.config import ComputeConfig
from nnscaler.runtime import (
    ParallelModule,
    build_optimizer,
    deduped_state_dict,
    load_deduped_state_dict,
    load_merged_state_dict,
    load_sharded_state_dict,
    merge_state_dicts,
)
from nnscaler.runtime.grads.zero import ZeroOptimizer

try:
    from .dist_util import run_dist
    from .test_module import LR, Gen, Wrapper, _close, _cpu, _same_opt, _same_state, _setup
    from .test_reducer import TINY_MB, _params_match, _rows
except ImportError:
    from dist_util import run_dist
    from test_module import LR, Gen, Wrapper, _close, _cpu, _same_opt, _same_state, _setup
    from test_reducer import TINY_MB, _params_match, _rows

WORLD = 4
CASES = [  # plan_ngpus, zero_ngroups, zero_use_reduce_scatter, use_async_reducer, zero_stage
    (1, 1, False, False, 1),
    (1, 2, False, True, 1),
    (1, 1, True, True, 1),
    (1, 2, True, False, 1),
    (2, 1, True, True, 1),
    (1, 1, True, False, 2),
    (1, 2, True, True, 2),
    (2, 1, True, True, 2),
]

Config = ComputeConfig


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def _fresh(rank: int, cfg: ComputeConfig, full: dict[str, torch.Tensor] | None) -> tuple[Gen, ZeroOptimizer]:
    pm = Gen(rank, WORLD, cfg.plan_ngpus, init_params=False)
    pm.compute_config = cfg
    if full is not None:
        pm.load_merged_state_dict(full)
    else:
        with torch.no_grad():
            for t in [*pm.parameters(), *pm.buffers()]:
                t.fill_(123.0)
    opt = build_optimizer(pm, _adamw)
    assert isinstance(opt, ZeroOptimizer)
    return pm, opt


def _train_case(rank: int, plan: int, ngroups: int, scatter: bool, async_op: bool, stage: int) -> None:
    case = f"plan={plan} zero_ngroups={ngroups} reduce_scatter={scatter} async={async_op} stage={stage}"
    cfg = Config(
        plan,
        WORLD,
        use_zero=True,
        zero_ngroups=ngroups,
        zero_use_reduce_scatter=scatter,
        use_async_reducer=async_op,
        reducer_bucket_cap_mb=TINY_MB,
        zero_stage=stage,
    )
    ref, full, x, t = _setup()
    ref_opt = _adamw(ref.parameters())
    pm, opt = _fresh(rank, cfg, full)
    # an LR scheduler drives the wrapped optimizer through the wrapper's param_groups
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt, ref_opt)]
    red = pm.reducer
    assert red is not None and red.zero and red.stage == stage and len(red.buckets) >= 4
    assert dist.get_world_size(red.zero_group) == WORLD // plan // ngroups
    rows = _rows(rank, WORLD, plan)
    for step in range(3):
        pm(x[rows], t[rows]).backward()
        ref(x, t).backward()
        if step == 1:
            ref_norm = float(nn.utils.clip_grad_norm_(ref.parameters(), 0.05))
            _close(float(opt.clip_gnorm(0.05)), ref_norm, f"{case}: clip_gnorm")
        opt.step()
        if stage == 2:
            assert red.nbytes()["grads"] == 0 and all(p.grad is None for p in pm.parameters())
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        for sched in scheds:
            sched.step()
        _params_match(pm, ref, f"{case}: parameters after step {step}")

    # gradient accumulation over 2 micro-batches, with and without no_sync: the norm of the
    # accumulated (and sharded) gradients is the single-device one
    for use_no_sync in (True, False):
        for part in range(2):
            r = _rows(rank, WORLD, plan, part, 2)
            if use_no_sync and part == 0:
                with pm.no_sync():
                    pm(x[r], t[r]).backward()
            else:
                pm(x[r], t[r]).backward()
            everyone = torch.cat([_rows(q, WORLD, plan, part, 2) for q in range(0, WORLD, plan)])
            ref(x[everyone], t[everyone]).backward()
        ref_norm = float(nn.utils.clip_grad_norm_(ref.parameters(), float("inf")))
        _close(float(opt.clip_gnorm()), ref_norm, f"{case}: accumulated gradients (no_sync={use_no_sync})")
        opt.zero_grad()
        ref_opt.zero_grad()

    # the ranks' state dicts merge into the single-device ones
    sd, opt_sd = _cpu(pm.state_dict()), copy.deepcopy(opt.state_dict())
    everyone: list[Any] = [None] * WORLD
    dist.all_gather_object(everyone, (sd, opt_sd))
    merged, merged_opt = merge_state_dicts([s for s, _ in everyone], [o for _, o in everyone])
    _same_state(merged, ref.state_dict(), f"{case}: merged model")
    assert merged_opt is not None
    _same_opt(merged_opt, ref_opt.state_dict(), f"{case}: merged optimizer")
    if plan == 1 and rank == 0:
        first = list(range(WORLD // ngroups))  # one ZeRO group is enough
        _, part = merge_state_dicts([everyone[r][0] for r in first], [everyone[r][1] for r in first])
        assert part is not None
        _same_opt(part, ref_opt.state_dict(), f"{case}: optimizer merged from ranks {first}")
        with pytest.raises(ValueError, match="lacks ZeRO slices"):
            merge_state_dicts([everyone[0][0]], [everyone[0][1]])

    # load back: merged (any plan), own (same plan), deduped; then all train on alike
    pm2, opt2 = _fresh(rank, cfg, None)
    load_merged_state_dict(pm2, {**merged, "freq": ref.freq}, opt2, merged_opt)
    _same_state(pm2.state_dict(), sd, f"{case}: load_merged_state_dict model")
    _same_opt(opt2.state_dict(), opt_sd, f"{case}: load_merged_state_dict optimizer")
    pm3, opt3 = _fresh(rank, cfg, full)
    load_sharded_state_dict(pm3, sd, opt3, opt_sd)
    _same_opt(opt3.state_dict(), opt_sd, f"{case}: load_sharded_state_dict optimizer")
    dd_model, dd_opt = deduped_state_dict(pm, opt)
    assert dd_opt is not None and bool(dd_opt["state"]) == (rank // plan < WORLD // plan // ngroups)
    pm4, opt4 = _fresh(rank, cfg, None)
    load_deduped_state_dict(pm4, dd_model, opt4, copy.deepcopy(dd_opt))  # not sharing opt's live state
    pm4.freq.copy_(ref.freq)  # a non-persistent buffer: in no state dict
    pm4.mark_non_persistent_buffers_inited()  # set by hand: forward may run
    _same_state(pm4.state_dict(), sd, f"{case}: load_deduped_state_dict model")
    _same_opt(opt4.state_dict(), opt_sd, f"{case}: load_deduped_state_dict optimizer")
    for module, optim in [(pm, opt), (pm2, opt2), (pm4, opt4)]:
        module(x[rows], t[rows]).backward()
        optim.step()
    _same_state(pm2.state_dict(), pm.state_dict(), f"{case}: training after load_merged_state_dict")
    _same_state(pm4.state_dict(), pm.state_dict(), f"{case}: training after load_deduped_state_dict")


class Wide(ParallelModule):
    """A two-layer perceptron replicated on every rank (plan_ngpus 1): 12,384 parameters."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__(rank=rank, world_size=world, plan_ngpus=1, groups={}, all_groups=[])
        self.add_shard("w1", "w1", (96, 64), torch.float32)
        self.add_shard("b1", "b1", (96,), torch.float32)
        self.add_shard("w2", "w2", (64, 96), torch.float32)
        self.load_shards(False)
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0.0, 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.relu(F.linear(x, self.w1, self.b1)), self.w2).pow(2).mean()


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )


def _memory(rank: int) -> dict[str, float]:
    """Measured / theoretical bytes per rank (fp32, Adam): parameters 4Ψ, gradients 4Ψ (4Ψ/N at
    stage 2), optimizer state 8Ψ/N, for N ranks sharing the state."""
    psi = 96 * 64 * 2 + 96
    out = {}
    for ngroups, stage in [(0, 0), (1, 1), (2, 1), (1, 2), (2, 2)]:  # ngroups 0: no ZeRO
        torch.manual_seed(0)
        pm = Wide(rank, WORLD)
        zero = dict(use_zero=True, zero_ngroups=ngroups, zero_stage=stage) if ngroups else {}
        pm.compute_config = Config(1, WORLD, **zero)
        opt = build_optimizer(pm, torch.optim.Adam, lr=LR)
        pm(torch.randn(4, 64)).backward()
        opt.step()
        assert pm.reducer is not None
        held = pm.reducer.nbytes()
        n = WORLD // ngroups if ngroups else 1
        what = f"zero_ngroups={ngroups} stage={stage}"
        out[f"{what} optimizer state"] = _state_bytes(opt) / (8 * psi / n)
        out[f"{what} gradients"] = (held["grads"] + held["grad_slices"]) / (
            4 * psi / (n if stage == 2 else 1)
        )
        out[f"{what} parameters"] = sum(p.numel() * p.element_size() for p in pm.parameters()) / (4 * psi)
        if ngroups:
            out[f"{what} flat parameters"] = held["params"] / (4 * psi)
        if stage == 2:
            assert all(p.grad is None for p in pm.parameters())
    return out


def _train_wrapped(rank: int) -> None:
    """A user model holding a ZeRO ParallelModule and a parameter outside it (averaged, not sharded)."""
    cfg = Config(1, WORLD, use_zero=True, zero_ngroups=2, reducer_bucket_cap_mb=TINY_MB, zero_stage=2)
    ref, full, x, t = _setup()
    wrapped_ref = Wrapper(ref)
    model = Wrapper(Gen(rank, WORLD, 1, init_params=False))
    model.body.compute_config = cfg
    load_merged_state_dict(model, {**wrapped_ref.state_dict(), "body.freq": ref.freq})
    opt = build_optimizer(model, _adamw)
    assert isinstance(opt, ZeroOptimizer)
    ref_opt = _adamw(wrapped_ref.parameters())
    rows = _rows(rank, WORLD, 1)
    for step in range(2):
        model(x[rows], t[rows]).backward()
        wrapped_ref(x, t).backward()
        if step == 1:
            ref_norm = float(nn.utils.clip_grad_norm_(wrapped_ref.parameters(), 0.05))
            _close(float(opt.clip_gnorm(0.05)), ref_norm, "wrapped: clip_gnorm")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    everyone: list[Any] = [None] * WORLD
    dist.all_gather_object(everyone, (_cpu(model.state_dict()), copy.deepcopy(opt.state_dict())))
    merged, merged_opt = merge_state_dicts([s for s, _ in everyone], [o for _, o in everyone])
    _same_state(merged, wrapped_ref.state_dict(), "wrapped: merged model")
    assert merged_opt is not None
    _same_opt(merged_opt, ref_opt.state_dict(), "wrapped: merged optimizer")


def zero_worker(rank: int, world: int) -> dict[str, float]:
    assert world == WORLD
    for case in CASES:
        _train_case(rank, *case)
    _train_wrapped(rank)
    return _memory(rank)


@pytest.mark.timeout(150)
def test_zero_matches_single_device_and_shards_memory() -> None:
    ratios = run_dist(zero_worker, WORLD, timeout=140)
    for rank, r in enumerate(ratios):
        for what, ratio in r.items():
            assert abs(ratio - 1) < 0.05, f"rank {rank} {what}: {ratio:.3f} x the theoretical bytes"
