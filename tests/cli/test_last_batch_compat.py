"""The setup check of an epoch's short last micro-batch as nnScaler 0.8's users meet it: the sample is
fetched the DataLoader's way (a dataset with only `__getitems__`), and a run that stops before the
end of the epoch is not refused for a batch it would never reach."""

from __future__ import annotations

import torch

from nnscaler.cli import Trainer, TrainerArgs
from nnscaler.cli.last_batch import reaches, short_micro_batch
from tests.cli.common import CONFIGS, CountingTokens, gpt_args
from tests.cli.conventions import run_expecting_error
from tests.dist_util import spawn


class BatchedTokens(CountingTokens):
    """A dataset read only in batches (`__getitems__`, which torch's DataLoader fetcher calls)."""

    def __getitem__(self, i: int):
        raise NotImplementedError("read in batches: __getitems__")

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        return [CountingTokens.__getitem__(self, i) for i in indices]


def test_a_dataset_with_only_getitems_passes_setup_and_trains(tmp_path):
    # 30 samples in micro-batches of 4: a last one of 2, fetched at setup through __getitems__
    data = {"dataset.type": "tests.cli.test_last_batch_compat.BatchedTokens", "dataset.train_args.size": 30}
    trainer = Trainer(
        gpt_args(tmp_path, "dp", 1, 1, max_train_steps=8, **data, **{"checkpoint.no_save": None})
    )
    trainer.run()
    assert trainer.total_train_steps_per_epoch == 4 and len(trainer.losses) == 8
    assert trainer.losses[-1] < trainer.losses[0]


def test_reaches_counts_the_epochs_optimizer_steps():
    # 29 samples, micro-batch 4, 2 per step, 1 replica: 8 micro-batches, 4 steps, the last short
    args = TrainerArgs.from_cli(gpt_args(CONFIGS, "data", 2, 2, **{"dataset.train_args.size": 29}))
    short = short_micro_batch(args, args.create_dataset("train"), "train", 1)
    assert short is not None and reaches(args, short)  # max_train_steps 8
    args.max_train_steps = 3
    assert not reaches(args, short)
    args.max_train_steps, args.max_epochs = None, 1
    assert reaches(args, short)


def _each(rank: int, world: int, runs: list[list[str]]) -> list[str]:
    return [run_expecting_error(rank, world, argv) for argv in runs]


def test_a_run_stopping_before_the_short_batch_is_not_refused(tmp_path):
    # 29 samples under `data` on 2 ranks: 4 steps an epoch, the last micro-batch holds 1 sample the
    # plan cannot split. 3 steps never reach it; 4 steps do and are refused as before.
    base = {"dataset.train_args.size": 29, "checkpoint.no_save": None}
    runs = [gpt_args(tmp_path, "data", 2, 2, max_train_steps=n, **base) for n in (3, 4)]
    for short_run, full_run in spawn(_each, 2, tmp_path, runs):
        assert short_run == ""
        assert full_run.startswith("ConfigError: dataset.train_args: the train set has 29 samples"), full_run
        assert "cannot take (it needs idx_size0 % 2 == 0" in full_run
