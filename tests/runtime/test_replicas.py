"""Identical replicas by construction (issue 10), on 2 gloo ranks with a tiny model:

- ranks seeded differently still hold one model after `parallelize` (default
  init_params_sync='broadcast'): dp replicas equal rank 0's weights (non-persistent buffers too),
  tp ranks compute rank 0's single-device output; the user's module is left as it was; small
  buckets and a rank whose module is on the meta device load rank 0's weights too;
- init_params_sync='check' raises naming the first tensor that differs and the ranks, passes when
  the ranks were seeded alike; a bad value is a ConfigError;
- a module planned for 2 devices refuses forward / train_step without its process group;
- two tp ranks fed different batch sizes raise a clear error on both ranks (forward and
  train_step), also when one rank's shape repeats a shape it saw before.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nnscaler import ComputeConfig, parallelize
from nnscaler.errors import ConfigError
from nnscaler.runtime.module_parts.replicas import _buckets, _manifest, full_weights, load_initial_weights
from tests.dist_util import spawn

RUN_LIMIT = 120.0


class Tiny(nn.Module):
    """Two linears, a persistent and a non-persistent buffer, all used by the output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)
        self.register_buffer("scale", torch.rand(8))
        self.register_buffer("shift", torch.rand(8), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))) * self.scale + self.shift


class TinyLoss(Tiny):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(super().forward(x), y)


def _x(batch: int = 4) -> torch.Tensor:
    return torch.randn(batch, 8, generator=torch.Generator().manual_seed(0))


def _local_tensors(pm: Any) -> dict[str, torch.Tensor]:
    """Every registered tensor of a ParallelModule (non-persistent buffers too), by original name."""
    return {info.original_name: pm._tensor(local).detach().clone() for local, info in pm.fullmap.items()}


# ---- broadcast ------------------------------------------------------------------------------------


def _unseeded(rank: int, world_size: int, gen: str) -> dict[str, Any]:
    torch.manual_seed(100 + rank)  # every rank builds a different model
    model = Tiny()
    before = {k: v.clone() for k, v in full_weights(model).items()}
    x = _x()
    expected = model(x).detach()
    dp = parallelize(model, {"x": x}, "dp", ComputeConfig(1, 2), gen_savedir=f"{gen}/dp")
    tp = parallelize(model, {"x": x}, "tp", ComputeConfig(2, 2), gen_savedir=f"{gen}/tp")
    dp_weights, dp_out = _local_tensors(dp), dp(x).detach()
    # another model, loaded in buckets of at most 100 bytes; rank 1 built it without storage
    with torch.device("meta" if rank == 1 else "cpu"):
        other = Tiny()
    load_initial_weights(dp, other, "broadcast", bucket_bytes=100)
    return {
        "before": before,
        "expected": expected,
        "dp_weights": dp_weights,
        "dp_out": dp_out,
        "other": {k: v.clone() for k, v in full_weights(other).items()} if rank == 0 else None,
        "small_buckets": _local_tensors(dp),
        "tp_out": tp(x).detach(),
        "tp_sharded": any(info.shard is not None for info in tp.fullmap.values()),
        "untouched": all(torch.equal(v, before[k]) for k, v in full_weights(model).items()),
    }


def test_broadcast_makes_unseeded_ranks_one_model(tmp_path: Any) -> None:
    r0, r1 = spawn(_unseeded, 2, tmp_path, str(tmp_path / "gen"), timeout=RUN_LIMIT)
    assert not torch.equal(r0["before"]["fc1.weight"], r1["before"]["fc1.weight"])  # they did differ
    for r in (r0, r1):
        assert (
            set(r["dp_weights"])
            == set(r0["before"])
            == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "scale", "shift"}
        )
        for name, value in r["dp_weights"].items():
            assert torch.equal(value, r0["before"][name]), name  # rank 0's, bit for bit
        torch.testing.assert_close(r["dp_out"], r0["expected"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["tp_out"], r0["expected"], rtol=1e-5, atol=1e-6)
        assert r["tp_sharded"]  # the tp plan really splits the weights
        assert r["untouched"]  # the user's module keeps its own weights
        for name, value in r["small_buckets"].items():
            assert torch.equal(value, r0["other"][name]), name


def test_tied_weights_are_sent_once_in_buckets_of_one_dtype() -> None:
    model = Tiny()
    model.fc3 = nn.Linear(8, 16)
    model.fc3.weight = model.fc1.weight  # tied: two names, one tensor
    model.register_buffer("count", torch.arange(40))  # int64: a bucket of its own
    manifest = _manifest(full_weights(model), True, "broadcast", None)
    assert manifest.same_as == {"fc3.weight": "fc1.weight"}
    buckets = [[manifest.names[i] for i in b] for b in _buckets(manifest, bucket_bytes=600)]
    sent = [n for b in buckets for n in b]
    assert "fc3.weight" not in sent and sorted(sent) == sorted(set(manifest.names) - {"fc3.weight"})
    assert ["count"] in buckets  # int64 never shares a bucket with float32
    assert max(len(b) for b in buckets) > 1  # small tensors share a bucket
    sizes = dict(zip(manifest.names, manifest.shapes))
    assert all(sum(4 * math.prod(sizes[n]) for n in b) <= 600 for b in buckets if b != ["count"])


# ---- check ------------------------------------------------------------------------------------------


def _check_mode(rank: int, world_size: int, gen: str) -> dict[str, str]:
    out = {}
    for case in ("seeded", "unseeded", "one_bias", "one_buffer"):
        torch.manual_seed(rank if case == "unseeded" else 0)
        model = Tiny()
        with torch.no_grad():
            if case == "one_bias" and rank == 1:
                model.fc2.bias[3] += 1e-3
            if case == "one_buffer" and rank == 1:
                model.shift[0] = 5.0  # non-persistent: not in state_dict, still compared
        try:
            pm = parallelize(
                model, {"x": _x()}, "tp", ComputeConfig(2, 2), gen_savedir=gen, init_params_sync="check"
            )
            out[case] = "ok" if torch.allclose(pm(_x()), model(_x())) else "wrong output"
        except RuntimeError as exc:
            out[case] = str(exc)
    return out


def test_check_names_the_first_tensor_that_differs(tmp_path: Any) -> None:
    for out in spawn(_check_mode, 2, tmp_path, str(tmp_path / "gen"), timeout=RUN_LIMIT):
        assert out["seeded"] == "ok"
        # the first in state-dict order (the module's own buffer before its children's parameters)
        assert (
            "buffer 'scale' differs between ranks: ranks [1] hold other values than rank 0" in out["unseeded"]
        )
        assert "6 of 6 tensors differ" in out["unseeded"]
        assert "torch.manual_seed" in out["unseeded"] and "init_params_sync='broadcast'" in out["unseeded"]
        assert "parameter 'fc2.bias' differs" in out["one_bias"] and "1 of 6 tensors" in out["one_bias"]
        assert "buffer 'shift' differs" in out["one_buffer"]


def test_bad_init_params_sync_lists_the_choices(tmp_path: Any) -> None:
    with pytest.raises(
        ConfigError, match=r"init_params_sync='bcast' is not one of \['broadcast', 'check', 'none'\]"
    ):
        parallelize(
            Tiny(), {"x": _x()}, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path, init_params_sync="bcast"
        )


# ---- no process group -------------------------------------------------------------------------------


def test_module_for_two_devices_refuses_to_run_alone(tmp_path: Any) -> None:
    model = TinyLoss()
    batch = {"x": _x(), "y": torch.zeros(4, 8)}
    for policy, cfg in (
        ("tp", ComputeConfig(2, 2)),
        ("dp", ComputeConfig(1, 2)),
        ("tp", ComputeConfig(2, 2, use_end2end=True)),
    ):
        pm = parallelize(model, batch, policy, cfg, gen_savedir=tmp_path / f"{policy}{cfg.use_end2end}")
        assert pm.world_size == 2  # built fine: state_dict and inspection need no process group
        assert set(pm.state_dict()) >= {"fc1.weight", "scale"}
        what = "train_step" if cfg.use_end2end else "forward"
        with pytest.raises(RuntimeError) as info:
            if cfg.use_end2end:
                pm.train_step([batch])
            else:
                pm(**batch)
        msg = str(info.value)
        assert f"GenModel.{what}: this module is rank 0 of a plan for 2 devices" in msg
        assert "torch.distributed is not initialised" in msg
        assert "torchrun" in msg and "nnscaler.init()" in msg and "ComputeConfig(1, 1)" in msg


# ---- input shapes across tp ranks ------------------------------------------------------------------


def _different_batches(rank: int, world_size: int, gen: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyLoss()
    dummy = {"x": _x(), "y": torch.zeros(4, 8)}
    fwd = parallelize(model, dummy, "tp", ComputeConfig(2, 2), gen_savedir=f"{gen}/fwd")
    step = parallelize(model, dummy, "tp", ComputeConfig(2, 2, use_end2end=True), gen_savedir=f"{gen}/e2e")
    out: dict[str, Any] = {"same": float(fwd(**dummy))}  # equal shapes: runs
    n = 4 if rank == 0 else 3  # rank 0 repeats the shape it ran with, rank 1's changed
    batch = {"x": _x(n), "y": torch.zeros(n, 8)}
    for name, call in (("forward", lambda: fwd(**batch)), ("train_step", lambda: step.train_step([batch]))):
        start = time.monotonic()
        try:
            call()
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)
        out[f"{name}_s"] = time.monotonic() - start
    out["after"] = float(fwd(**dummy))  # the ranks are still in step
    return out


def test_different_batch_sizes_on_tp_ranks_raise_on_both(tmp_path: Any) -> None:
    for out in spawn(_different_batches, 2, tmp_path, str(tmp_path / "gen"), timeout=RUN_LIMIT):
        assert out["after"] == out["same"]
        for name, where in (("forward", "x"), ("train_step", "samples[0]['x']")):
            msg = out[name]
            assert f"GenModel.{name}: the ranks that run one copy of the plan (global ranks [0, 1])" in msg
            assert f"{where} has shape [4, 8] on rank 0, [3, 8] on rank 1" in msg
            assert "also different" in msg and "y" in msg
            assert "rank // plan_ngpus" in msg and "not by the global rank" in msg
            assert out[f"{name}_s"] < 5.0
