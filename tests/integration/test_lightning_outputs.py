"""A pipelined LightningModule whose forward returns more than the loss: `self(...)` in training and
validation gives the forward's whole output (the loss averaged over the micro-batches, counts summed,
per-sample tensors concatenated), and training still matches one device.

Run as `torchrun --nproc_per_node 2 -m tests.integration.test_lightning_outputs OUT` by the fixture."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nnscaler.integration.lightning.outputs import combine_micro_outputs
from tests.integration.lightning_case import Regressor, _nnscaler, _trainer, loader, reference_weights

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2


class WithExtras(Regressor):
    """Regressor whose forward also returns its predictions and a count."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        for block in self.blocks:
            x = block(x)
        pred = self.head(x)
        return torch.nn.functional.mse_loss(pred, y), {"pred": pred, "positive": (y > 0).sum()}

    def _check(self, batch, what: str):
        loss, extra = self(**batch)
        self.seen.append(
            {
                "what": what,
                "pred_shape": list(extra["pred"].shape),
                "positive_ok": int(extra["positive"]) == int((batch["y"] > 0).sum()),
                "loss_ok": bool(
                    torch.allclose(loss, torch.nn.functional.mse_loss(extra["pred"], batch["y"]))
                ),
            }
        )
        return loss

    def training_step(self, batch, batch_idx):
        return self._check(batch, "train")

    def validation_step(self, batch, batch_idx):
        self._check(batch, "val")


def main(out: Path) -> None:
    pp = {"use_end2end": True, "pas_config": {"pipeline_nmicros": 2, "pipeline_nstages": 2}}
    strategy, plugins = _nnscaler("pp", 2, out, "pp_outputs", **pp)
    trainer = _trainer(strategy, STEPS, out, plugins=plugins)
    model = WithExtras()
    trainer.fit(model, loader(), loader())
    trainer.save_checkpoint(out / "pp_outputs.ckpt")
    if trainer.is_global_zero:
        (out / "seen.json").write_text(json.dumps(model.seen))
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lightning_outputs")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += ["-m", "tests.integration.test_lightning_outputs", str(out)]
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out


def test_pipelined_call_returns_the_whole_output(runs, tmp_path):
    from nnscaler.integration.lightning.pytorch import NnScalerStrategy

    seen = json.loads((runs / "seen.json").read_text())
    assert [s["what"] for s in seen].count("train") == STEPS and "val" in {s["what"] for s in seen}
    for s in seen:  # the micro-batches' predictions put back together: the whole batch of 4
        assert s == {"what": s["what"], "pred_shape": [4, 8, 4], "positive_ok": True, "loss_ok": True}, s
    merged_file = tmp_path / "merged.ckpt"
    NnScalerStrategy.merge_checkpoint([runs / "pp_outputs.ckpt"], merged_file)
    merged = torch.load(merged_file, weights_only=False)["state_dict"]
    for k, v in reference_weights(STEPS, 1).items():
        torch.testing.assert_close(merged[k], v, rtol=1e-5, atol=1e-6, msg=k)


class Net(torch.nn.Module):
    """Four linears (two pipeline stages); the forward returns the loss, the predictions and a count."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return torch.nn.functional.mse_loss(x, y), {"pred": x, "positive": (y > 0).sum()}


def _whole_outputs(rank: int, world_size: int, policy: str, savedir: str) -> list:
    import nnscaler
    from nnscaler import ComputeConfig, parallelize

    nnscaler.init()
    model = Net()
    g = torch.Generator().manual_seed(1)
    micro = [{"x": torch.randn(4, 8, generator=g), "y": torch.randn(4, 8, generator=g)} for _ in range(2)]
    pas = {"pipeline_nmicros": 2, "pipeline_nstages": 2} if policy == "pp" else {}
    cfg = ComputeConfig(2, world_size, use_end2end=True, pas_config=pas)
    pm = parallelize(model, micro[0], policy, cfg, gen_savedir=savedir)
    trained = pm.train_step(micro, return_outputs=True)
    inferred = pm.infer_step(micro, return_outputs=True)
    with torch.no_grad():
        want = [model(**m) for m in micro]
    return [trained, inferred, want, pm.train_step(micro)]


@pytest.mark.parametrize("policy", ["tp", "pp"])
def test_train_step_returns_whole_outputs(tmp_path, policy):
    """The runtime under the strategy: every rank (every pipeline stage) gets each micro-batch's output."""
    from tests.dist_util import spawn

    for rank, (trained, inferred, want, losses) in enumerate(
        spawn(_whole_outputs, 2, tmp_path, policy, str(tmp_path))
    ):
        assert len(trained) == len(inferred) == 2 and all(isinstance(x, torch.Tensor) for x in losses), rank
        for (loss, extra), (w_loss, w_extra) in zip(trained, want):
            assert set(extra) == {"pred", "positive"} and not loss.requires_grad, (rank, extra)
            torch.testing.assert_close(loss, w_loss, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(extra["pred"], w_extra["pred"], rtol=1e-5, atol=1e-6)
            assert int(extra["positive"]) == int(w_extra["positive"])
        assert inferred[0][1]["pred"].shape == (4, 8)


def test_combine_micro_outputs_rules():
    outs = [
        (
            torch.tensor(1.0),
            {"n": torch.tensor(3), "acc": torch.tensor(0.5), "p": torch.ones(2, 3), "tag": "a"},
        ),
        (
            torch.tensor(3.0),
            {"n": torch.tensor(4), "acc": torch.tensor(1.0), "p": torch.zeros(1, 3), "tag": "b"},
        ),
    ]
    loss, extra = combine_micro_outputs(outs, train=True)
    assert float(loss.detach()) == 2.0 and loss.requires_grad and loss.is_leaf
    assert int(extra["n"]) == 7 and float(extra["acc"]) == 0.75 and extra["tag"] == "a"
    assert torch.equal(extra["p"], torch.cat([torch.ones(2, 3), torch.zeros(1, 3)]))
    assert not combine_micro_outputs([torch.tensor(2.0)], train=False).requires_grad


if __name__ == "__main__":
    main(Path(sys.argv[1]))
