"""`trainer.train_status` as nnScaler 0.8's hooks read it (`finished_train_steps`, `best_loss`
attributes) while our dict keys, `dict(status)` and the checkpoint format stay as they were."""

from __future__ import annotations

import math

import torch

from nnscaler.cli import Trainer
from nnscaler.cli.trainer import TrainStatus
from tests.cli.common import gpt_args

SEEN: list[tuple[int, float, int]] = []


def record_status(trainer) -> None:
    """An nnScaler 0.8 hook body: reads the attributes, next to our dict key."""
    status = trainer.train_status
    SEEN.append((status.finished_train_steps, status.best_loss, status["step"]))


def test_dict_access_is_kept_next_to_the_attributes():
    status = TrainStatus()
    assert status.finished_train_steps == 0 and status.best_loss == math.inf
    status["step"] += 2
    status.finished_train_steps += 1
    assert status.step == status["step"] == status.finished_train_steps == 3
    status.update({"next_epoch": 1, "next_sample": 8, "best_loss": 0.5})
    assert dict(status) == {"next_epoch": 1, "next_sample": 8, "step": 3, "best_loss": 0.5}
    status.update({"finished_train_steps": 7})  # a status nnScaler 0.8 wrote
    assert status["step"] == 7 and "finished_train_steps" in status and status.get("missing", 1) == 1
    status["other"] = 1  # any key, as on a dict: saved and restored with the rest
    assert dict(status)["other"] == 1 and len(status) == 5
    status.clear()
    assert dict(status) == {"next_epoch": 0, "next_sample": 0, "step": 0, "best_loss": math.inf}


def test_hooks_read_the_attributes_and_a_checkpoint_resumes(tmp_path):
    hook = {"hook.after_optimizer_step": "tests.cli.test_train_status_compat.record_status"}
    every = {"checkpoint.every_n_train_steps": 2}
    SEEN.clear()
    first = Trainer(gpt_args(tmp_path, "dp", 1, 1, max_train_steps=4, **every, **hook))
    first.run()
    # after_optimizer_step runs before the step is counted: 0..3; a checkpoint at step 2 set best_loss
    assert [s[0] for s in SEEN] == [0, 1, 2, 3] and [s[2] for s in SEEN] == [0, 1, 2, 3]
    assert SEEN[0][1] == math.inf and math.isfinite(SEEN[3][1])
    assert first.train_status.finished_train_steps == 4 and math.isfinite(first.train_status.best_loss)
    saved = torch.load(tmp_path / "ckpt" / "last" / "0.ckpt", weights_only=False)["train_status"]
    assert type(saved) is dict and set(saved) == {"next_epoch", "next_sample", "step", "best_loss"}
    assert saved["step"] == 4 and saved == dict(first.train_status)

    SEEN.clear()
    resume = {"checkpoint.resume_from": "last", **every, **hook}
    second = Trainer(gpt_args(tmp_path, "dp", 1, 1, max_train_steps=6, **resume))
    second.run()
    assert [s[0] for s in SEEN] == [4, 5] and len(second.losses) == 2
    assert SEEN[0][1] == saved["best_loss"]  # restored from the checkpoint
    assert second.train_status.finished_train_steps == second.train_status["step"] == 6
