"""Non-persistent buffers of a module built without its initial weights (issue 31; nnScaler 0.8's
tests/parallel_module/test_checkpoint_buffer.py), on real gloo ranks:

- rank 0 builds with init_module_params=True, rank 1 with False (ComputeConfig(1, 2)): rank 1's flag
  is False and its buffer is not the model's; broadcast_weights makes both True and equal, and the
  forward then runs and matches the single-device model;
- a source rank without initialised buffers makes broadcast_weights raise on every rank (no hang);
- one rank, init_module_params=False: forward and train_step refuse, naming the buffer; after setting
  it and mark_non_persistent_buffers_inited() they run; a model without such buffers is unaffected.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nnscaler
from nnscaler import ComputeConfig, parallelize
from tests.dist_util import spawn

RUN_LIMIT = 120.0
NOT_INITED = "Non-persistent buffers haven't been initialized."


class WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("buf", torch.ones(4), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + self.buf


class WithBufferLoss(WithBuffer):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(super().forward(x), y)


class NoBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0))  # persistent: in every state dict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


def _x() -> torch.Tensor:
    return torch.randn(2, 4, generator=torch.Generator().manual_seed(0))


def _buf(pm: Any) -> torch.Tensor:
    local = next(n for n, i in pm.fullmap.items() if i.original_name == "buf")
    return pm._tensor(local).detach().clone()


def _refuses(call: Any) -> str:
    try:
        call()
    except RuntimeError as err:
        return str(err)
    raise AssertionError("ran with uninitialised non-persistent buffers")


def _mixed(rank: int, world_size: int, gen: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model, x = WithBuffer(), _x()
    expected = model(x).detach()
    pm = parallelize(
        model, {"x": x}, "dp", ComputeConfig(1, 2), gen_savedir=gen, init_module_params=rank == 0
    )
    before = (pm.non_presistent_buffers_inited, _buf(pm))
    refused = "" if rank == 0 else _refuses(lambda: pm(x))
    nnscaler.broadcast_weights(pm)
    return {
        "before": before,
        "refused": refused,
        "after": (pm.non_presistent_buffers_inited, pm.non_persistent_buffers_inited, _buf(pm)),
        "out": pm(x).detach(),
        "expected": expected,
    }


def test_broadcast_initialises_the_other_rank(tmp_path: Any) -> None:
    r0, r1 = spawn(_mixed, 2, tmp_path, str(tmp_path / "gen"), timeout=RUN_LIMIT)
    assert r0["before"][0] is True and torch.equal(r0["before"][1], torch.ones(4))
    assert r1["before"][0] is False and torch.isnan(r1["before"][1]).all()  # unwritten: NaN, not stale memory
    assert NOT_INITED in r1["refused"] and "'buf'" in r1["refused"]
    assert "mark_non_persistent_buffers_inited" in r1["refused"]
    for r in (r0, r1):
        assert r["after"][:2] == (True, True)
        assert torch.equal(r["after"][2], torch.ones(4))
        torch.testing.assert_close(r["out"], r["expected"])


def _no_source(rank: int, world_size: int, gen: str) -> str:
    torch.manual_seed(0)
    pm = parallelize(
        WithBuffer(), {"x": _x()}, "dp", ComputeConfig(1, 2), gen_savedir=gen, init_module_params=False
    )
    assert pm.non_presistent_buffers_inited is False
    model_sd, _ = nnscaler.deduped_state_dict(pm)
    nnscaler.load_deduped_state_dict(pm, model_sd)  # loads and broadcasts the rest, but not the buffer
    return pm.non_presistent_buffers_inited, _refuses(lambda: nnscaler.broadcast_weights(pm))


def test_broadcast_from_uninitialised_source_raises_everywhere(tmp_path: Any) -> None:
    results = spawn(_no_source, 2, tmp_path, str(tmp_path / "gen"), timeout=RUN_LIMIT)
    for after_load, err in results:  # both ranks raise (neither waits for the other)
        assert after_load is False  # no checkpoint holds the buffer
        assert NOT_INITED in err and "source rank 0" in err and "'buf'" in err


def _single(rank: int, world_size: int, gen: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model, x = WithBufferLoss(), _x()
    y = torch.zeros(2, 4)
    expected = model(x, y).detach()
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("nnscaler.runtime.module").addHandler(handler)  # ParallelModule's logger
    pm = parallelize(
        model,
        {"x": x, "y": y},
        "dp",
        ComputeConfig(1, 1, use_end2end=True),
        gen_savedir=f"{gen}/buf",
        init_module_params=False,
    )
    pm.load_state_dict(model.state_dict() | {k: v for k, v in pm.state_dict().items() if k.startswith("_")})
    flag = pm.non_presistent_buffers_inited  # a state dict cannot fill the buffer
    refused = [_refuses(lambda: pm(x, y)), _refuses(lambda: pm.train_step([{"x": x, "y": y}]))]
    refused.append(_refuses(lambda: pm.infer_step([{"x": x, "y": y}])))
    with torch.no_grad():
        _local = next(n for n, i in pm.fullmap.items() if i.original_name == "buf")
        pm._tensor(_local).fill_(1.0)
    pm.mark_non_persistent_buffers_inited()
    out = pm(x, y).detach()
    losses = pm.train_step([{"x": x, "y": y}])
    plain = parallelize(
        NoBuffer(), {"x": x}, "dp", ComputeConfig(1, 1), gen_savedir=f"{gen}/plain", init_module_params=False
    )
    return {
        "flag": flag,
        "warned": records,
        "refused": refused,
        "after": pm.non_presistent_buffers_inited,
        "out": out,
        "loss": losses[0].detach(),
        "expected": expected,
        "plain": (plain.non_presistent_buffers_inited, tuple(plain(x).shape)),
    }


def test_single_rank_refuses_until_marked(tmp_path: Any) -> None:
    (r,) = spawn(_single, 1, tmp_path, str(tmp_path / "gen"), timeout=RUN_LIMIT)
    assert r["flag"] is False
    assert len(r["warned"]) == 1 and "'buf'" in r["warned"][0]
    assert "mark_non_persistent_buffers_inited" in r["warned"][0]
    for what, err in zip(("forward", "train_step", "infer_step"), r["refused"]):
        assert NOT_INITED in err and "'buf'" in err and what in err, err
    assert r["after"] is True
    torch.testing.assert_close(r["out"], r["expected"])
    torch.testing.assert_close(r["loss"], r["expected"])
    assert r["plain"] == (True, (2, 4))


if __name__ == "__main__":
    pytest.main([__file__, "-q", "-n", "0"])
