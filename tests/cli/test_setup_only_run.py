"""max_epochs / max_train_steps of -1: the Trainer sets up and trains no step, as nnScaler 0.8's own
tests use it (tests/cli/test_trainer.py::test_tracing_from_weights, "will exit without training")."""

from __future__ import annotations

import pytest

from nnscaler.cli import Trainer, TrainerArgs
from nnscaler.errors import ConfigError
from tests.cli.common import gpt_args


def test_minus_one_sets_up_without_training(tmp_path):
    argv = gpt_args(tmp_path, "dp", 1, 1, max_epochs=-1, max_train_steps=-1, **{"checkpoint.no_save": None})
    trainer = Trainer(argv)
    trainer.run()
    assert trainer.losses == [] and trainer.model is not None


def test_other_negative_counts_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="max_train_steps must be >= 0"):
        TrainerArgs.from_cli(gpt_args(tmp_path, "dp", 1, 1, max_train_steps=-2))
