"""Copies of a ParallelModule on 2 gloo ranks, after its gradient reducer was built (an EMA or teacher
copy made during training): the copy syncs its own gradients over the same process groups and leaves
the original's alone; under tensor parallelism it computes with its own shards; under ZeRO stage 3
(whose reducer holds the parameters) `copy.deepcopy` and `pickle` are refused with what to do instead.

Before the fix (ParallelModule had no __deepcopy__) the test failed at its first copy: deepcopy went
into the original's reducer and stopped at "TypeError: cannot pickle 'ProcessGroup' object" (ZeRO-3
too, with no word of what to do)."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nnscaler import ComputeConfig, parallelize
from tests.copies.models import scramble
from tests.dist_util import spawn


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.fc2(torch.relu(self.fc1(x))), y)


def _batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(4, 8, generator=g), "y": torch.randn(4, 8, generator=g)}


def _grads(module: nn.Module) -> dict[str, Any]:
    """By original name."""
    names = module.dist_param_map
    return {names[n]: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}


def _ranks(rank: int, world_size: int, gen: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Tiny()
    out: dict[str, Any] = {}
    # data parallel: one training step builds the reducer, then the copy
    pm = parallelize(model, _batch(0), "dp", ComputeConfig(1, 2), gen_savedir=f"{gen}/dp")
    pm(**_batch(10 + rank)).backward()
    pm.sync_grad()
    original_grads = _grads(pm)
    ema = copy.deepcopy(pm)
    scramble(list(ema.parameters()), seed=3)  # the same values on both ranks
    out["ema_weights"] = {ema.dist_param_map[n]: p.detach().clone() for n, p in ema.named_parameters()}
    ema.zero_grad()
    local = ema(**_batch(20 + rank))
    local.backward()
    ema.sync_grad()
    out["ema_grads"] = _grads(ema)
    out["original_grads_after"] = _grads(pm)
    out["original_grads"] = original_grads
    out["original_shares_nothing"] = not {id(p) for p in pm.parameters()} & {id(p) for p in ema.parameters()}
    # tensor parallel: the copy's shards are its own, its collectives run on the same groups
    tp = parallelize(model, _batch(0), "tp", ComputeConfig(2, 2), gen_savedir=f"{gen}/tp")
    before = float(tp(**_batch(1)))
    twin = copy.deepcopy(tp)
    out["tp_copy_same"] = float(twin(**_batch(1))) == before
    scramble(list(twin.parameters()), seed=4 + rank)
    out["tp_copy_changed"] = float(twin(**_batch(1))) != before
    out["tp_original_kept"] = float(tp(**_batch(1))) == before
    # ZeRO-3: refused once the reducer holds the parameters
    z3 = parallelize(
        model, _batch(0), "dp", ComputeConfig(1, 2, use_zero=True, zero_stage=3), gen_savedir=f"{gen}/z3"
    )
    z3(**_batch(10 + rank)).backward()
    z3.sync_grad()
    out["zero3"] = []
    for how in (copy.deepcopy, pickle.dumps):
        try:
            how(z3)
            out["zero3"].append("copied")
        except RuntimeError as exc:
            out["zero3"].append(str(exc))
    return out


def test_deepcopy_after_the_reducer_was_built(tmp_path):
    per_rank = spawn(_ranks, 2, tmp_path, str(tmp_path / "gen"), timeout=180)
    # the reference: the copy's weights on one device, the mean of both ranks' gradients
    reference = Tiny()
    reference.load_state_dict(per_rank[0]["ema_weights"])
    grads = []
    for rank in range(2):
        reference.zero_grad()
        reference(**_batch(20 + rank)).backward()
        grads.append({n: p.grad.clone() for n, p in reference.named_parameters()})
    for rank, r in enumerate(per_rank):
        assert r["original_shares_nothing"]
        for name, g in r["ema_grads"].items():
            torch.testing.assert_close(g, (grads[0][name] + grads[1][name]) / 2, msg=f"rank {rank} {name}")
        for name, g in r["original_grads_after"].items():  # the copy's backward left them as they were
            torch.testing.assert_close(g, r["original_grads"][name], msg=f"rank {rank} {name}")
        assert r["tp_copy_same"] and r["tp_copy_changed"] and r["tp_original_kept"], r
        for message, how in zip(r["zero3"], ("copy.deepcopy", "pickle")):
            assert f"cannot be copied with {how}: under ZeRO stage 3" in message, message
            assert "load_state_dict(module.state_dict())" in message, message
