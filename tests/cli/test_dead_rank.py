"""A rank that dies mid-run (SIGKILL) makes the others stop with an error naming it, not hang."""

from __future__ import annotations

import os
import signal
import time

import pytest

from nnscaler.cli import Trainer, TrainHook
from tests.cli.common import gpt_args
from tests.dist_util import SpawnError, spawn


class DieAtStep3(TrainHook):
    def on_step_start(self, trainer, epoch, idx):
        if trainer.rank == 1 and trainer.train_status["step"] == 2:
            os.kill(os.getpid(), signal.SIGKILL)


def _train(rank: int, world: int, argv: list[str]) -> None:
    Trainer(argv).run()


def test_peer_death_is_named(tmp_path):
    argv = gpt_args(
        tmp_path,
        "tp",
        2,
        2,
        **{"hook.type": "tests.cli.test_dead_rank.DieAtStep3", "checkpoint.no_save": None},
    )
    with pytest.raises(SpawnError) as info:
        spawn(_train, 2, tmp_path, argv, timeout=120)
    message = str(info.value)
    print(message[-3000:])
    assert "rank 0 raised nnscaler.runtime.dist.store_sync.PeerError" in message
    assert "rank 0: rank 1 died" in message and "training step 3" in message


class FreezeAtStep3(TrainHook):
    def on_step_start(self, trainer, epoch, idx):
        if trainer.rank == 1 and trainer.train_status["step"] == 2:
            # frozen: connections open, no heartbeat, no progress (then gone, so the test ends early)
            trainer.heartbeat.stop()
            time.sleep(8)
            os._exit(0)


def test_frozen_peer_is_named_by_the_heartbeat_watchdog(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("NNSCALER_HEARTBEAT_TIMEOUT", "4")
    argv = gpt_args(
        tmp_path,
        "tp",
        2,
        2,
        **{"hook.type": "tests.cli.test_dead_rank.FreezeAtStep3", "checkpoint.no_save": None},
    )
    with pytest.raises(SpawnError, match="rank 0 died with exit code 1"):
        spawn(_train, 2, tmp_path, argv, timeout=120)
    err = capfd.readouterr().err
    assert (
        "nnscaler: PeerError: rank 0: rank 1 died (sent no heartbeat for 4 s), during training step 3" in err
    )
