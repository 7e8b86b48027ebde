"""The trainer with robust gradient aggregation from the command line (docs/faulty_replicas.md): a
YAML-driven tiny GPT on 4 gloo ranks with `--compute_config.grad_aggregation zeno` (scored on each
step's last micro-batch) while rank 3 sends NaN gradients ($NNSCALER_FAULT_INJECT): the loss falls, the
weights stay finite, and every step's metrics count the steps replica 3 was dropped in
(`robust/dropped_rank3`); a pipeline plan is refused before it compiles."""

from __future__ import annotations

import math
import os
from typing import Any

import pytest

from nnscaler.cli import Trainer
from nnscaler.errors import ConfigError
from nnscaler.runtime.grads.fault_inject import FAULT_ENV
from tests.cli.common import gpt_args
from tests.dist_util import spawn


def _train(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    os.environ[FAULT_ENV] = "rank=3,kind=nan"
    trainer = Trainer(argv)
    logged: list[dict[str, float]] = []
    trainer.log_metrics = lambda metrics, step=None, *, tag=None: logged.append(dict(metrics))
    trainer.run()
    finite = all(math.isfinite(float(p.detach().abs().sum())) for p in trainer.model.parameters())
    return {"losses": trainer.losses, "logged": logged, "finite": finite}


def test_zeno_from_the_cli_drops_a_nan_replica(tmp_path):
    overrides = {
        "checkpoint.no_save": None,
        "compute_config.grad_aggregation": "zeno",
        "compute_config.zeno_gamma": "0.01",
        "max_train_steps": 4,
    }
    results = spawn(_train, 4, tmp_path, gpt_args(tmp_path, "dp", 1, 4, **overrides), timeout=200)
    losses = results[0]["losses"]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert all(r["finite"] for r in results)
    train = [m for m in results[0]["logged"] if "train/loss" in m]
    assert [m["robust/dropped_rank3"] for m in train] == [1.0, 2.0, 3.0, 4.0]
    assert all(m["robust/dropped_rank0"] == 0.0 for m in train)


def test_a_pipeline_plan_is_refused(tmp_path):
    argv = gpt_args(
        tmp_path, "pp", 2, 2, **{"compute_config.grad_aggregation": "zeno", "run_mode": "compile"}
    )
    argv += ["--compute_config.pas_config.pipeline_nmicros", "2", "--compute_config.byzantine_b", "0"]
    with pytest.raises(ConfigError, match="not supported with pipeline stages"):
        Trainer(argv).run()
