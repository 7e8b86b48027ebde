"""Directory fields of TrainerArgs take a pathlib.Path as well as a str, as nnScaler 0.8's own tests
give them (tests/cli/test_resume_seed.py: gen_savedir=tmp_path / 'src'); a file is still refused."""

from __future__ import annotations

import pytest
import torch

from nnscaler.cli import TrainerArgs
from nnscaler.cli.configs import CheckpointConfig, DatasetConfig, ModelConfig, OptimizerConfig
from nnscaler.config import ComputeConfig
from nnscaler.errors import ConfigError


def _args(gen_savedir, save_dir) -> TrainerArgs:
    return TrainerArgs(
        compute_config=ComputeConfig(plan_ngpus=1, runtime_ngpus=1, use_end2end=True),
        gen_savedir=gen_savedir,
        model=ModelConfig(type=torch.nn.Linear, args={"in_features": 2, "out_features": 2}),
        optimizer=OptimizerConfig(type=torch.optim.AdamW),
        dataset=DatasetConfig(type="tests.cli.common.CountingTokens", train_args={"size": 8}),
        checkpoint=CheckpointConfig(save_dir=save_dir),
        max_train_steps=1,
        seed=0,
    )


def test_directory_fields_take_a_path(tmp_path):
    args = _args(tmp_path / "src", tmp_path / "ckpt")
    assert str(args.gen_savedir) == str(tmp_path / "src")


def test_a_file_is_still_refused(tmp_path):
    path = tmp_path / "not_a_dir"
    path.write_text("x")
    with pytest.raises(ConfigError, match="gen_savedir: .* is a file"):
        _args(path, tmp_path / "ckpt")
