"""ZeRO stage 1 on 4 gloo ranks: training equals single-device AdamW for zero_ngroups 1 and 2, with
all-reduce or reduce-scatter, sync or async reducer, pure data parallel and tp 2 x dp 2; the merged
optimizer state equals the single-device one; checkpoints load back; optimizer state per rank is
8Ψ/N bytes for Adam in fp32."""

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
from nnscaler.runtime.zero import ZeroOptimizer

try:
    from .dist_util import run_dist
    from .test_module import LR, Gen, _close, _cpu, _same_opt, _same_state, _setup
    from .test_reducer import TINY_MB, _params_match, _rows
except ImportError:
    from dist_util import run_dist
    from test_module import LR, Gen, _close, _cpu, _same_opt, _same_state, _setup
    from test_reducer import TINY_MB, _params_match, _rows

WORLD = 4
CASES = [  # plan_ngpus, zero_ngroups, zero_use_reduce_scatter, use_async_reducer
    (1, 1, False, False),
    (1, 2, False, True),
    (1, 1, True, True),
    (1, 2, True, False),
    (2, 1, True, True),
]


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


def _train_case(rank: int, plan: int, ngroups: int, scatter: bool, async_op: bool) -> None:
    case = f"plan={plan} zero_ngroups={ngroups} reduce_scatter={scatter} async={async_op}"
    cfg = ComputeConfig(
        plan,
        WORLD,
        use_zero=True,
        zero_ngroups=ngroups,
        zero_use_reduce_scatter=scatter,
        use_async_reducer=async_op,
        reducer_bucket_cap_mb=TINY_MB,
    )
    ref, full, x, t = _setup()
    ref_opt = _adamw(ref.parameters())
    pm, opt = _fresh(rank, cfg, full)
    red = pm.reducer
    assert red is not None and red.zero and len(red.buckets) >= 4
    assert dist.get_world_size(red.zero_group) == WORLD // plan // ngroups
    rows = _rows(rank, WORLD, plan)
    for step in range(3):
        pm(x[rows], t[rows]).backward()
        ref(x, t).backward()
        if step == 1:
            ref_norm = float(nn.utils.clip_grad_norm_(ref.parameters(), 0.05))
            _close(opt.clip_gnorm(0.05), ref_norm, f"{case}: clip_gnorm")
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        _params_match(pm, ref, f"{case}: parameters after step {step}")

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
    psi = 96 * 64 * 2 + 96
    out = {}
    for ngroups in (0, 1, 2):  # 0: no ZeRO
        torch.manual_seed(0)
        pm = Wide(rank, WORLD)
        pm.compute_config = ComputeConfig(1, WORLD, use_zero=ngroups > 0, zero_ngroups=max(ngroups, 1))
        opt = build_optimizer(pm, torch.optim.Adam, lr=LR)
        pm(torch.randn(4, 64)).backward()
        opt.step()
        want = 8 * psi / (WORLD // ngroups if ngroups else 1)
        out[f"zero_ngroups={ngroups}"] = _state_bytes(opt) / want
    return out


def zero_worker(rank: int, world: int) -> dict[str, float]:
    assert world == WORLD
    for case in CASES:
        _train_case(rank, *case)
    return _memory(rank)


@pytest.mark.timeout(150)
def test_zero1_matches_single_device_and_shards_state() -> None:
    ratios = run_dist(zero_worker, WORLD, timeout=140)
    for rank, r in enumerate(ratios):
        for what, ratio in r.items():
            assert abs(ratio - 1) < 0.05, f"rank {rank} {what}: optimizer state is {ratio:.3f} x 8Ψ/N bytes"
