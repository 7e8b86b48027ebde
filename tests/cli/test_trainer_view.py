"""The Trainer satisfies `TrainerView` (the Protocol hooks and TrainerArgs see it through), and the
trainer's checkpoint directories are written by the runtime's atomic writer, crash or no crash."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nnscaler.cli import Trainer
from nnscaler.cli import checkpoint as ck
from nnscaler.cli.trainer_view import TrainerView
from tests.cli.common import gpt_args


def test_trainer_satisfies_trainer_view(tmp_path):
    trainer = Trainer(gpt_args(tmp_path, "dp", 1, 1, max_train_steps=1))
    assert isinstance(trainer, TrainerView)


def test_checkpoint_dir_replaces_the_old_one_whole(tmp_path):
    first = ck.write_checkpoint_dir(tmp_path, "0000-0001", 0, {"0.ckpt": {"v": 1}}, {"step": 1})
    again = ck.write_checkpoint_dir(tmp_path, "0000-0001", 0, {"0.ckpt": {"v": 2}}, {"step": 2})
    assert first == again == tmp_path / "0000-0001"
    assert torch.load(again / "0.ckpt", weights_only=False) == {"v": 2}
    assert json.loads((again / ck.COMPLETE_FILE).read_text()) == {"step": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000-0001"]  # no temporary left


def test_a_failed_write_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "merged.ckpt"
    ck.atomic_torch_save({"v": 1}, path)

    def broken(p: Path, obj: object) -> None:
        p.write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(ck, "_write_file", broken)
    with pytest.raises(OSError, match="disk full"):
        ck.atomic_torch_save({"v": 2}, path)
    assert torch.load(path, weights_only=False) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["merged.ckpt"]
