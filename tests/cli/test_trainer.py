"""The trainer end to end on 2 gloo ranks: a YAML-driven tiny GPT trains under tp and under pp."""

from __future__ import annotations

import pytest
import torch

from nnscaler.cli import Trainer
from tests.cli.common import gpt_args
from tests.dist_util import spawn


def _train(rank: int, world: int, argv: list[str]) -> list[float]:
    trainer = Trainer(argv)
    trainer.run()
    return trainer.losses


def test_gpt_trains_on_two_ranks_under_tp_and_pp(tmp_path):
    # 36 samples, 4 per micro-batch, 2 micro-batches per step: every epoch ends with a short step,
    # which the pipeline pads with a dummy micro-batch
    common = {"checkpoint.no_save": None, "dataset.train_args.size": 36}
    tp = spawn(_train, 2, tmp_path, gpt_args(tmp_path / "tp", "tp", 2, 2, **common))
    pipeline = {"compute_config.pas_config.pipeline_nmicros": 2}
    pp = spawn(_train, 2, tmp_path, gpt_args(tmp_path / "pp", "pp", 2, 2, **common, **pipeline))
    print("tp", tp[0], "\npp", pp[0])
    for losses in (tp, pp):
        assert losses[0] == losses[1]  # every rank reports the same aggregated loss
        assert len(losses[0]) == 8
        assert losses[0][-1] < losses[0][0] - 0.5
    torch.testing.assert_close(pp[0], tp[0], rtol=1e-5, atol=1e-5)  # the same training, another plan
    assert (tmp_path / "tp" / "gen").is_dir() and (tmp_path / "pp" / "gen").is_dir()


def one_token_per_micro_batch(outputs, sync_group):
    """per-token-mean with every micro-batch counted as one token: the same as mean."""
    from nnscaler.cli import AggregatedOutputs

    return AggregatedOutputs.aggregate(outputs, sync_group, lambda o: o, ntokens_fn=lambda o: 1)


def test_grad_and_loss_reductions(tmp_path):
    def run(name, **kw):
        sgd = {"optimizer.type": "torch.optim.SGD", "optimizer.args.lr": 0.5, "optimizer.clip_gnorm": 0}
        argv = gpt_args(
            tmp_path / name, "dp", 1, 1, max_train_steps=3, **{"checkpoint.no_save": None}, **sgd, **kw
        )
        trainer = Trainer(argv)
        trainer.run()
        return trainer.losses

    mean = run("mean")
    per_token = run(
        "tok",
        **{
            "optimizer.grad_reduction": "per-token-mean",
            "optimizer.loss_reduction": "per-token-mean",
            "optimizer.aggregate_outputs_fn": "tests.cli.test_trainer.one_token_per_micro_batch",
        },
    )
    assert per_token == pytest.approx(mean, rel=1e-6)
    summed = run("sum", **{"optimizer.loss_reduction": "sum", "optimizer.grad_reduction": "sum"})
    assert summed[0] == pytest.approx(2 * mean[0], rel=1e-6)  # 2 micro-batches per step
    assert summed[1] != pytest.approx(2 * mean[1], rel=1e-3)  # SGD: doubled gradients, another step


def test_torchrun_launches_the_cli(tmp_path):
    """The way users start it: torchrun (TCP store on a free port) running `-m nnscaler.cli.train`."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += ["-m", "nnscaler.cli.train", *gpt_args(tmp_path, "tp", 2, 2, max_train_steps=4)]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 4/4" in done.stdout
    assert [os.readlink(tmp_path / "ckpt" / "last" / f"{r}.ckpt") for r in (0, 1)] == [
        "../0000-0004/0.ckpt",
        "../0000-0004/1.ckpt",
    ]
