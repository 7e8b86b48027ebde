"""`trainer.fit(model, train_dl, val_dl)` on NnScalerStrategy with a LightningModule that has no
`train_dataloader()` (nanoGPT's train_nnscaler.py in nnScaler 0.8): `dummy_forward_args_fn` gets the
first batch of the loaders given to fit, and training matches one device. Run as a module under
torchrun (`python -m tests.integration.test_lightning_fit_dataloaders OUT_DIR`) it trains."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from nnscaler.errors import ConfigError
from nnscaler.integration.lightning.pytorch.dummy_batch import first_batch
from tests.integration.lightning_case import Regressor, _nnscaler, _trainer, loader, reference_weights

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


class FromBatch(Regressor):
    """The Regressor traced from a batch of the fit loop's data: no dummy dict, no train_dataloader."""

    def __init__(self) -> None:
        super().__init__()
        self.dummy_forward_args = None
        self.batches_seen: list[tuple[int, ...]] = []

    def dummy_forward_args_fn(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.batches_seen.append(tuple(batch["x"].shape))
        return batch


def main(out: Path) -> None:
    strategy, plugins = _nnscaler("tp", 2, out, "tp")
    trainer = _trainer(strategy, STEPS, out, plugins=plugins)
    model = FromBatch()
    trainer.fit(model, loader(), loader())
    assert model.batches_seen == [(4, 8, 16)], model.batches_seen
    trainer.save_checkpoint(out / "tp.ckpt")
    torch.distributed.destroy_process_group()


def test_fit_with_loaders_trains_like_one_device(tmp_path):
    from nnscaler.integration.lightning.pytorch import NnScalerStrategy

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += ["-m", "tests.integration.test_lightning_fit_dataloaders", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    merged = tmp_path / "merged.ckpt"
    NnScalerStrategy.merge_checkpoint([tmp_path / "tp.ckpt"], merged)
    got = torch.load(merged, weights_only=False)
    assert got["global_step"] == STEPS
    want = reference_weights(STEPS, 1)  # tp over 2 ranks: one replica, the plain single-device run
    assert set(got["state_dict"]) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(got["state_dict"][k], v, rtol=1e-5, atol=1e-6)


def _bare_trainer() -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)


def test_first_batch_reads_the_fit_loop_source_and_keeps_the_random_stream():
    trainer, model = _bare_trainer(), FromBatch()
    trainer._data_connector.attach_data(model, train_dataloaders=loader(), val_dataloaders=loader())
    torch.manual_seed(5)
    batch = first_batch(trainer, model)
    after = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(3))  # the loader's iterator drew no numbers seen outside
    torch.testing.assert_close(batch["x"], next(iter(loader()))["x"])
    pair = {"a": loader(), "b": [loader()]}  # a collection of loaders gives the same collection of batches
    trainer._data_connector.attach_data(model, train_dataloaders=pair)
    got = first_batch(trainer, model)
    assert set(got) == {"a", "b"} and isinstance(got["b"], list) and got["b"][0]["y"].shape == (4, 8, 4)


def test_no_batch_source_names_what_to_pass():
    with pytest.raises(ConfigError, match=r"trainer\.fit\(model, train_dataloaders=.*dummy_forward_args"):
        first_batch(_bare_trainer(), FromBatch())


if __name__ == "__main__":
    main(Path(sys.argv[1]))
