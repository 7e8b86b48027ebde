"""ZeRO stage 3 (nnscaler.runtime.grads.zero3) on 4 gloo ranks, with hand-written 'generated' modules:

- training with zero_ngroups 1 and 2 (and tp 2 x dp 2) equals single-device AdamW / Adam step by
  step (losses, clip_gnorm, merged parameters and optimizer state), also with gradient accumulation
  under `no_sync`; checkpoints merge, load back (merged, own, deduped) and training goes on alike;
  ZeRO groups of one rank fall back to plain data parallelism;
- a block's full parameters are not alive after its forward (the reducer's bookkeeping and weakrefs
  to the tensors handed out), at most the current and the prefetched block are gathered in forward,
  backward drops blocks as their gradients are reduced, and each rank holds 1/N of the parameters.
"""

from __future__ import annotations

import copy
import time
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nnscaler.config import ComputeConfig
from nnscaler.errors import ConfigError
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
from nnscaler.runtime.grads.zero3 import Zero3Reducer, block_of

try:
    from .dist_util import run_dist
    from .test_module import LR, Gen, _close, _cpu, _same_opt, _same_state, _setup
    from .test_reducer import _rows
except ImportError:
    from dist_util import run_dist
    from test_module import LR, Gen, _close, _cpu, _same_opt, _same_state, _setup
    from test_reducer import _rows

WORLD = 4
CASES = [  # plan_ngpus, zero_ngroups, optimizer
    (1, 1, "adamw"),
    (1, 2, "adam"),
    (2, 1, "adamw"),
]


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=LR)
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def _config(plan: int, ngroups: int) -> ComputeConfig:
    return ComputeConfig(plan, WORLD, use_zero=True, zero_ngroups=ngroups, zero_stage=3)


def _fresh(rank: int, cfg: ComputeConfig, full: dict[str, torch.Tensor] | None, opt_name: str):
    pm = Gen(rank, WORLD, cfg.plan_ngpus, init_params=False)
    pm.compute_config = cfg
    if full is not None:
        pm.load_merged_state_dict(full)
    else:
        with torch.no_grad():
            for t in [*pm.parameters(), *pm.buffers()]:
                t.fill_(123.0)  # garbage, so nothing passes by accident
    opt = build_optimizer(pm, lambda params: _optimizer(opt_name, params))
    assert isinstance(opt, ZeroOptimizer)
    return pm, opt


def _mean_loss(loss: torch.Tensor) -> float:
    """The mean over all ranks (each replica's ranks report its loss): the loss of the whole batch."""
    value = loss.detach().clone()
    dist.all_reduce(value)
    return float(value) / WORLD


def _merged(pm: ParallelModule, opt: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any], Any]:
    sd, opt_sd = _cpu(pm.state_dict()), copy.deepcopy(opt.state_dict())
    everyone: list[Any] = [None] * WORLD
    dist.all_gather_object(everyone, (sd, opt_sd))
    merged, merged_opt = merge_state_dicts([s for s, _ in everyone], [o for _, o in everyone])
    return merged, merged_opt, (sd, opt_sd)


def _train_case(rank: int, plan: int, ngroups: int, opt_name: str) -> None:
    case = f"plan={plan} zero_ngroups={ngroups} {opt_name}"
    cfg = _config(plan, ngroups)
    ref, full, x, t = _setup()
    ref_opt = _optimizer(opt_name, ref.parameters())
    pm, opt = _fresh(rank, cfg, full, opt_name)
    red = pm.reducer
    assert isinstance(red, Zero3Reducer) and red.stage == 3
    assert dist.get_world_size(red.zero_group) == WORLD // plan // ngroups
    assert [b.name for b in red.blocks] == ["", "ln", "fc1", "fc2"]
    rows = _rows(rank, WORLD, plan)
    for step in range(3):
        loss = pm(x[rows], t[rows])
        # the last block of forward stays gathered when backward needs it (it starts there)
        last = red._order[-1]
        kept = [last.name] if any(f.tokens for f in last.flats) else []
        assert red.live_blocks() == kept, f"{case}: blocks gathered after forward"
        loss.backward()
        assert red.live_blocks() == [], f"{case}: blocks gathered after backward"
        ref_loss = ref(x, t)
        ref_loss.backward()
        _close(_mean_loss(loss), float(ref_loss.detach()), f"{case}: loss at step {step}")
        if step == 1:
            ref_norm = float(nn.utils.clip_grad_norm_(ref.parameters(), 0.05))
            _close(float(opt.clip_gnorm(0.05)), ref_norm, f"{case}: clip_gnorm")
        opt.step()
        assert red.nbytes()["grads"] == 0 and all(p.grad is None for p in pm.parameters())
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()

    # gradient accumulation over 2 micro-batches, with and without no_sync
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
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()

    # the ranks' state dicts (full local tensors, gathered) merge into the single-device ones
    merged, merged_opt, (sd, opt_sd) = _merged(pm, opt)
    _same_state(merged, ref.state_dict(), f"{case}: merged model")
    _same_opt(merged_opt, ref_opt.state_dict(), f"{case}: merged optimizer")

    # load back: merged (any plan), own (same plan), deduped; then all train on alike
    pm2, opt2 = _fresh(rank, cfg, None, opt_name)
    load_merged_state_dict(pm2, {**merged, "freq": ref.freq}, opt2, merged_opt)
    _same_state(pm2.state_dict(), sd, f"{case}: load_merged_state_dict model")
    _same_opt(opt2.state_dict(), opt_sd, f"{case}: load_merged_state_dict optimizer")
    pm3, opt3 = _fresh(rank, cfg, None, opt_name)
    load_sharded_state_dict(pm3, sd, opt3, opt_sd)
    pm3.freq.copy_(ref.freq)  # a non-persistent buffer: in no state dict
    pm3.mark_non_persistent_buffers_inited()  # set by hand: forward may run
    _same_state(pm3.state_dict(), sd, f"{case}: load_sharded_state_dict model")
    _same_opt(opt3.state_dict(), opt_sd, f"{case}: load_sharded_state_dict optimizer")
    dd_model, dd_opt = deduped_state_dict(pm, opt)
    pm4, opt4 = _fresh(rank, cfg, None, opt_name)
    load_deduped_state_dict(pm4, dd_model, opt4, copy.deepcopy(dd_opt))
    pm4.freq.copy_(ref.freq)  # a non-persistent buffer: in no state dict
    pm4.mark_non_persistent_buffers_inited()  # set by hand: forward may run
    _same_state(pm4.state_dict(), sd, f"{case}: load_deduped_state_dict model")
    _same_opt(opt4.state_dict(), opt_sd, f"{case}: load_deduped_state_dict optimizer")
    for module, optim in [(pm, opt), (pm2, opt2), (pm3, opt3), (pm4, opt4)]:
        module(x[rows], t[rows]).backward()
        optim.step()
        optim.zero_grad()
    ref(x, t).backward()
    ref_opt.step()
    final = pm.state_dict()
    for other, how in [(pm2, "merged"), (pm3, "sharded"), (pm4, "deduped")]:
        _same_state(other.state_dict(), final, f"{case}: training after load_{how}_state_dict")
    merged, _, _ = _merged(pm, opt)
    _same_state(merged, ref.state_dict(), f"{case}: merged model after reloads")


# ---- what is alive when ----------------------------------------------------------------------------

LAYERS, WIDTH = 4, 32


class Stack(ParallelModule):
    """`layers.k.weight` / `layers.k.bias` for k < LAYERS plus a head: LAYERS + 1 blocks. Its forward
    records, after each layer, the blocks gathered and weakrefs to the tensors it was handed."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__(rank=rank, world_size=world, plan_ngpus=1, groups={}, all_groups=[])
        for k in range(LAYERS):
            self.add_shard(f"layers_{k}_weight", f"layers.{k}.weight", (WIDTH, WIDTH), torch.float32)
            self.add_shard(f"layers_{k}_bias", f"layers.{k}.bias", (WIDTH,), torch.float32)
        self.add_shard("head_weight", "head.weight", (1, WIDTH), torch.float32)
        self.load_shards(False)
        torch.manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0.0, 0.3)
        self.handed: list[weakref.ref] = []
        self.live_in_forward: list[list[str]] = []
        self.live_in_backward: list[list[str]] = []

    def _note_backward(self, grad: torch.Tensor) -> None:
        self.live_in_backward.append(self._zero3.live_blocks() if self._zero3 is not None else [])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k in range(LAYERS):
            w, b = getattr(self, f"layers_{k}_weight"), getattr(self, f"layers_{k}_bias")
            # the tensors handed out and the gathered buffer they view (kept alive by any view of it)
            self.handed += [weakref.ref(t) for t in (w, b, w._base, b._base) if t is not None]
            x = torch.tanh(F.linear(x, w, b))
            del w, b
            if x.requires_grad:
                x.register_hook(self._note_backward)
            if self._zero3 is not None:
                self.live_in_forward.append(self._zero3.live_blocks())
        return F.linear(x, self.head_weight).pow(2).mean()


def _reference_stack(rank: int) -> nn.Module:
    pm = Stack(rank, WORLD)
    ref = nn.Module()
    for name, p in zip([i.original_name for i in pm.fullmap.values()], pm.parameters()):
        parent = ref
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        parent.register_parameter(leaf, nn.Parameter(p.detach().clone()))
    return ref


def _reference_loss(ref: nn.Module, x: torch.Tensor) -> torch.Tensor:
    for k in range(LAYERS):
        layer = getattr(ref.layers, str(k))
        x = torch.tanh(F.linear(x, layer.weight, layer.bias))
    return F.linear(x, ref.head.weight).pow(2).mean()


def _all_dead(refs: list[weakref.ref], patience: float = 2.0) -> bool:
    """Whether every referent is gone. Gloo's worker thread lets go of a collective's output a moment
    after `wait()` returns (measured: ~20% of all-gathers here), so give it up to `patience` seconds."""
    deadline = time.monotonic() + patience
    while any(r() is not None for r in refs):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def _liveness(rank: int, prefetch: int) -> dict[str, float]:
    torch.manual_seed(1)
    x = torch.randn(8, WIDTH)
    ref = _reference_stack(rank)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    pm = Stack(rank, WORLD)
    pm.compute_config = ComputeConfig(1, WORLD, use_zero=True, zero_stage=3, zero3_prefetch_blocks=prefetch)
    opt = build_optimizer(pm, torch.optim.AdamW, lr=LR)
    red = pm.reducer
    assert isinstance(red, Zero3Reducer) and red.prefetch == prefetch
    # the all-gathers have a communicator of their own (NCCL: their own stream), over the same ranks
    assert red.gather_group is not red.zero_group
    assert dist.get_process_group_ranks(red.gather_group) == dist.get_process_group_ranks(red.zero_group)
    names = [f"layers.{k}" for k in range(LAYERS)] + ["head"]
    assert [b.name for b in red.blocks] == names
    rows = torch.arange(rank * 2, rank * 2 + 2)
    for step in range(3):
        pm.handed, pm.live_in_forward, pm.live_in_backward = [], [], []
        loss = pm(x[rows])
        # nothing handed out survives the forward: saved tensors hold tokens, not the parameters
        assert len(pm.handed) == 4 * LAYERS, "the parameters handed out view a gathered buffer"
        assert _all_dead(pm.handed), f"step {step}: gathered tensors alive after forward"
        # only the head stays gathered: backward starts with it
        assert red.live_blocks() == ["head"]
        assert red.nbytes()["gathered"] == 4 * WIDTH  # head.weight: 1 x WIDTH fp32
        for k, live in enumerate(pm.live_in_forward):
            # `prefetch` blocks ahead, from the second forward on (the first records the order)
            want = [names[k]] if step == 0 else names[k : k + 1 + prefetch]
            assert live == want, f"step {step}: after layer {k} gathered {live}, expected {want}"
        loss.backward()
        # in backward, the hook on layer k's output runs before layer k's backward: the blocks after
        # k are dropped by then (nothing saved for backward views them any more), and layer k and the
        # `prefetch - 1` before it are gathered already (prefetched when backward reached layer k + 1),
        # but for layer 0, whose weight nothing saved (its input needs no gradient)
        assert len(pm.live_in_backward) == LAYERS
        for k, live in zip(reversed(range(LAYERS)), pm.live_in_backward):
            want = [names[j] for j in range(max(k - prefetch + 1, 1), k + 1)]
            assert live == want, f"step {step}: {live} gathered in backward at layer {k}, expected {want}"
        assert red.live_blocks() == []
        ref_loss = _reference_loss(ref, x)
        ref_loss.backward()
        _close(_mean_loss(loss), float(ref_loss.detach()), f"stack: loss at step {step}")
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    merged, _, _ = _merged(pm, opt)
    _same_state(merged, ref.state_dict(), "stack: merged model")
    # per rank, the parameters take 1/N of the bytes (the registered parameters hold one element each)
    psi = sum(p.numel() for p in ref.parameters())
    placeholders = sum(p.untyped_storage().nbytes() for p in pm.parameters())
    assert placeholders == 4 * len(list(pm.parameters()))
    return {"stack parameters": (red.nbytes()["params"] + placeholders) / (4 * psi / WORLD)}


def _one_rank_groups(rank: int) -> None:
    """ZeRO groups of one rank each (zero_ngroups = dp size): nothing to shard, plain data parallel."""
    ref, full, x, t = _setup()
    ref_opt = _optimizer("adamw", ref.parameters())
    pm = Gen(rank, WORLD, 1, init_params=False)
    pm.compute_config = _config(1, WORLD)
    pm.load_merged_state_dict(full)
    opt = build_optimizer(pm, lambda params: _optimizer("adamw", params))
    assert pm.reducer is not None and not pm.reducer.zero and pm._zero3 is None
    rows = _rows(rank, WORLD, 1)
    for step in range(2):
        loss = pm(x[rows], t[rows])
        loss.backward()
        ref_loss = ref(x, t)
        ref_loss.backward()
        _close(_mean_loss(loss), float(ref_loss.detach()), f"one-rank ZeRO groups: loss at step {step}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    merged, _, _ = _merged(pm, opt)
    _same_state(merged, ref.state_dict(), "one-rank ZeRO groups: merged model")


def zero3_worker(rank: int, world: int) -> dict[str, float]:
    assert world == WORLD
    for case in CASES:
        _train_case(rank, *case)
    _one_rank_groups(rank)
    _liveness(rank, prefetch=2)
    return _liveness(rank, prefetch=1)


@pytest.mark.timeout(120)
def test_zero3_matches_single_device_and_frees_blocks() -> None:
    ratios = run_dist(zero3_worker, WORLD, timeout=110)
    for rank, r in enumerate(ratios):
        for what, ratio in r.items():
            assert abs(ratio - 1) < 0.05, f"rank {rank} {what}: {ratio:.3f} x the theoretical bytes"


# ---- one process ------------------------------------------------------------------------------------


def test_block_of_follows_codegen_sections() -> None:
    assert block_of("transformer.h.0.attn.c_attn.weight") == "transformer.h.0"
    assert block_of("model.layers.11.mlp.up_proj.weight") == "model.layers.11"
    assert block_of("transformer.wte.weight") == "transformer.wte"
    assert block_of("fc1.weight") == "fc1"
    assert block_of("scale") == ""


def test_zero_stage_is_validated() -> None:
    assert ComputeConfig(1, 4, use_zero=True, zero_stage=3).zero_stage == 3
    with pytest.raises(ConfigError, match=r"zero_stage must be 1 .* 2 .* or 3 .* got 4"):
        ComputeConfig(1, 4, use_zero=True, zero_stage=4)
