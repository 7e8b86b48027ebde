"""ZeRO stages 1, 2 and 3 under NnScalerStrategy: the user's optimizer (and its LR scheduler) steps
this rank's slices; training matches one device, the checkpoints merge to the plain module's weights.

Run as `torchrun --nproc_per_node 2 -m tests.integration.test_lightning_zero OUT` by the fixture."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.lightning_case import LR, Regressor, _nnscaler, _trainer, loader, reference_weights

ROOT = Path(__file__).resolve().parents[2]
STAGES = (1, 2, 3)
STEPS = 3


class ScheduledRegressor(Regressor):
    """The same module with an LR scheduler that keeps the rate (so one device is still the reference)
    and counts its steps: it must stay bound to the optimizer that actually steps."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=LR)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def main(out: Path) -> None:
    for stage in STAGES:
        name = f"zero{stage}"
        strategy, plugins = _nnscaler("dp", 1, out, name, use_zero=True, zero_stage=stage)
        trainer = _trainer(strategy, STEPS, out, plugins=plugins, gradient_clip_val=100.0)
        model = ScheduledRegressor()
        trainer.fit(model, loader(), loader())
        opt = trainer.optimizers[0]
        assert type(opt).__name__ == "ZeroOptimizer", type(opt)
        assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == STEPS
        trainer.save_checkpoint(out / f"{name}.ckpt")
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lightning_zero")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += ["-m", "tests.integration.test_lightning_zero", str(out)]
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_zero_matches_one_device(runs, tmp_path, stage):
    from nnscaler.integration.lightning.pytorch import NnScalerStrategy

    merged_file = tmp_path / "merged.ckpt"
    NnScalerStrategy.merge_checkpoint([runs / f"zero{stage}.ckpt"], merged_file)
    merged = torch.load(merged_file, weights_only=False)
    assert merged["global_step"] == STEPS
    want = reference_weights(STEPS, 2)
    assert set(merged["state_dict"]) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(merged["state_dict"][k], v, rtol=1e-5, atol=1e-6, msg=f"zero{stage}: {k}")
    names = merged["optimizer_states"][0]["param_groups"][0]["param_names"]
    assert sorted(names) == sorted(k for k in want if not k.endswith("_extra_state"))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
