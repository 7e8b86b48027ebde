"""Training through faulty replicas on 4 gloo ranks (docs/faulty_replicas.md): one replica sends its
gradient sign-flipped x10 every step ($NNSCALER_FAULT_INJECT). Under `mean` the loss ends above where it
started; `median`, `trimmed_mean` and `zeno` (through train_step, scoring on the step's last
micro-batch) end within 10% of the clean run's final loss, record the faulty replica as dropped, and
warn about it. NaN gradients from one replica never reach the weights under the robust modes (also
under ZeRO 1 and 2)."""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

from nnscaler.config import ComputeConfig
from nnscaler.runtime import ParallelModule, build_optimizer
from nnscaler.runtime.grads.fault_inject import FAULT_ENV
from nnscaler.runtime.pipeline import PipelineStep
from tests.dist_util import spawn

D_IN, D_OUT, ROWS, STEPS, LR = 8, 4, 16, 30, 0.5
FLIP = "rank=3,kind=sign_flip,scale=10,every=1"
NAN = "rank=3,kind=nan,every=1"


class Lin(ParallelModule):
    """A hand-written 'generated' linear regression, data parallel over every rank, end-to-end mode."""

    forward_args = ("x", "t")

    def __init__(self, rank: int, world: int) -> None:
        super().__init__(
            rank=rank,
            world_size=world,
            plan_ngpus=1,
            groups={"tp": [rank], "dp": list(range(world))},
            all_groups=[[r] for r in range(world)] + [list(range(world))],
        )
        self.add_shard("weight", "weight", (D_OUT, D_IN), torch.float32)
        self.add_shard("bias", "bias", (D_OUT,), torch.float32)
        self.load_shards(False)
        with torch.no_grad():
            self.weight.zero_()
            self.bias.zero_()

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return ((F.linear(x, self.weight, self.bias) - t) ** 2).mean()


def _train_step(model, samples, is_dummy_batch=None, scale_fn=None):
    """What codegen writes for a plan without pipeline stages (codegen/schedule_code.plain_train_lines)."""
    pipe = PipelineStep(model, samples, train=True, scale_fn=scale_fn, is_dummy_batch=is_dummy_batch)
    for micro, kwargs in enumerate(pipe.kwargs):
        outputs = pytree.tree_leaves(model(**kwargs))
        pipe.loss(outputs, micro)
        pipe.backward_loss(outputs, micro)
    return pipe.finish()


def _teacher() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(D_OUT, D_IN, generator=gen), torch.randn(D_OUT, generator=gen)


def _batch(seed: int, rows: int) -> dict[str, torch.Tensor]:
    w, b = _teacher()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, D_IN, generator=gen)
    return {"x": x, "t": x @ w.T + b + 0.3 * torch.randn(rows, D_OUT, generator=gen)}


def _run(rank: int, world: int, mode: str, fault: str | None, steps: int, **cfg: Any) -> dict[str, Any]:
    os.environ.pop(FAULT_ENV, None)
    if fault:
        os.environ[FAULT_ENV] = fault
    pm = Lin(rank, world)
    pm.compute_config = ComputeConfig(
        1,
        world,
        use_end2end=True,
        grad_aggregation=mode,
        **({"zeno_gamma": LR} if mode == "zeno" else {}),
        **cfg,
    )
    opt = build_optimizer(pm, torch.optim.SGD, lr=LR)
    held = _batch(999, 256)
    with torch.no_grad():
        start = float(pm(**held))
    finite = True
    for step in range(steps):
        micro = [_batch(1000 * step + 10 * rank + m, ROWS // 2) for m in range(2)]
        pm.train_step(micro, scale_fn=lambda loss: loss / 2)
        opt.step()
        opt.zero_grad()
        finite = finite and all(bool(torch.isfinite(p).all()) for p in pm.parameters())
    with torch.no_grad():
        end = float(pm(**held))
    os.environ.pop(FAULT_ENV, None)
    stats = pm.aggregation_stats
    return {
        "start": start,
        "end": end,
        "finite": finite,
        "dropped": list(stats.dropped) if stats is not None else None,
        "metrics": stats.as_metrics() if stats is not None else None,
    }


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def convergence_worker(rank: int, world: int) -> dict[str, Any]:
    warnings = _Warnings()
    logging.getLogger("nnscaler.runtime.grads").addHandler(warnings)
    out = {"clean": _run(rank, world, "mean", None, STEPS)}
    for mode in ("mean", "median", "trimmed_mean", "zeno"):
        out[mode] = _run(rank, world, mode, FLIP, STEPS)
    for mode, extra in [
        ("median", {}),
        ("trimmed_mean", {"use_zero": True, "zero_stage": 2}),
        ("zeno", {}),
        ("zeno", {"use_zero": True, "zero_stage": 1}),
    ]:
        out[f"nan {mode} {extra}"] = _run(rank, world, mode, NAN, 3, **extra)
    out["warnings"] = warnings.messages
    return out


def test_robust_modes_train_through_a_sign_flipping_replica_and_nan(tmp_path) -> None:
    results = spawn(convergence_worker, 4, tmp_path, timeout=200)
    r0 = results[0]
    clean = r0["clean"]
    assert clean["end"] < 0.5 * clean["start"], f"the clean run must learn: {clean}"
    assert r0["mean"]["end"] > r0["mean"]["start"], f"mean must diverge under a x10 sign flip: {r0['mean']}"
    for mode in ("median", "trimmed_mean", "zeno"):
        got = r0[mode]
        assert math.isclose(got["end"], clean["end"], rel_tol=0.1), (
            f"{mode}: {got['end']} vs clean {clean['end']}"
        )
        assert got["dropped"][3] == STEPS and sum(got["dropped"][:3]) < STEPS, (
            f"{mode}: dropped {got['dropped']}"
        )
        assert got["metrics"]["robust/dropped_rank3"] == STEPS
    for key, got in r0.items():
        if key.startswith("nan "):
            assert all(r[key]["finite"] for r in results), f"{key}: NaN reached the weights"
            assert math.isfinite(got["end"]) and got["dropped"][3] == 3, f"{key}: {got}"
    for mode in ("median", "trimmed_mean", "zeno"):
        assert any(
            f"grad_aggregation={mode!r} dropped the gradient of data-parallel replica 3" in m
            for m in r0["warnings"]
        )
    assert all(not r["warnings"] for r in results[1:]), "only rank 0 warns"
