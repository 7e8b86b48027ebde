"""Checkpoints: resuming gives bitwise the same losses; a SIGKILL mid-write leaves `last` usable;
bad resume paths fail naming the path; keep_last_n and best; a fresh run moves an earlier one aside."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nnscaler.cli import Trainer
from nnscaler.errors import CheckpointError
from tests.cli.common import gpt_args
from tests.dist_util import spawn

ROOT = Path(__file__).resolve().parents[2]


def _train(rank: int, world: int, argv: list[str]) -> list[float]:
    trainer = Trainer(argv)
    trainer.run()
    return trainer.losses


@pytest.mark.parametrize(
    "save_type, policy, plan, zero, every, at",
    [
        ("sharded", "tp", 2, False, "every_n_epochs", 5),  # saved at the end of epoch 0
        ("deduped", "dp", 1, False, "every_n_train_steps", 3),  # saved within epoch 1
        ("deduped", "dp", 1, True, "every_n_train_steps", 3),
    ],
)
def test_resume_gives_bitwise_equal_losses(tmp_path, save_type, policy, plan, zero, every, at):
    # 40 samples: 5 steps per epoch on one replica (tp), 3 per replica on two (dp; the last one short),
    # so the runs cross epochs; dropout checks that every random state is restored
    common = {
        "checkpoint.save_type": save_type,
        "dataset.train_args.size": 40,
        "model.args.config.dropout": 0.1,
        "max_train_steps": 7,
        "compute_config.use_zero": zero,  # ZeRO: each replica saves and restores its optimizer slice
    }
    full_argv = gpt_args(tmp_path, policy, plan, 2, **common, **{f"checkpoint.{every}": 1 if at == 5 else at})
    full_argv += ["--checkpoint.every_n_train_steps!"] if every == "every_n_epochs" else []
    full = spawn(_train, 2, tmp_path, full_argv)[0]
    ckpt = next((tmp_path / "ckpt").glob(f"000?-000{at}"))
    assert json.loads((ckpt / "complete.json").read_text())["save_type"] == save_type
    resumed_argv = gpt_args(tmp_path, policy, plan, 2, **common, **{"checkpoint.resume_from": str(ckpt)})
    resumed_argv[resumed_argv.index("--checkpoint.save_dir") + 1] = str(tmp_path / "ckpt2")
    resumed = spawn(_train, 2, tmp_path, resumed_argv)[0]
    print(save_type, full, resumed)
    assert len(full) == 7 and resumed == full[at:]  # bitwise: float equality
    merged = tmp_path / "merged.ckpt"
    Trainer.merge_checkpoint(str(ckpt), str(merged))
    # torch.load's default (weights_only=True) reads both the merged and the per-rank files
    state = torch.load(merged)
    assert torch.load(ckpt / "0.ckpt")["train_status"]["step"] == at
    assert state["model"]["lm_head.weight"].shape == (64, 32) and state["train_status"]["step"] == at
    assert len(state["optimizer"]["state"]) == len(state["optimizer"]["param_groups"][0]["param_names"])


def _cli(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(var, None)
    return subprocess.run(
        [sys.executable, "-m", "nnscaler.cli.train", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
    )


def test_sigkill_while_writing_leaves_a_resumable_checkpoint(tmp_path):
    steps = {"checkpoint.every_n_train_steps": 2, "max_train_steps": 6}
    killed = _cli(
        gpt_args(tmp_path, "dp", 1, 1, init_module="tests.cli.kill_on_second_save", **steps), tmp_path
    )
    assert killed.returncode == -9, killed.stderr[-3000:]
    save_dir = tmp_path / "ckpt"
    assert os.readlink(save_dir / "last" / "0.ckpt") == "../0000-0002/0.ckpt"
    assert (save_dir / ".tmp-0000-0004").is_dir() and not (save_dir / "0000-0004").exists()

    resumed = Trainer(gpt_args(tmp_path, "dp", 1, 1, **steps, **{"checkpoint.resume_from": "last"}))
    resumed.run()
    assert resumed.train_status["step"] == 6 and len(resumed.losses) == 4
    assert os.readlink(save_dir / "last" / "0.ckpt") == "../0000-0006/0.ckpt"
    assert not (save_dir / ".tmp-0000-0004").exists()  # the next save cleared the debris

    reference = Trainer(gpt_args(tmp_path / "ref", "dp", 1, 1, **steps))
    reference.run()
    assert resumed.losses == reference.losses[2:]


def test_bad_resume_paths_name_the_path(tmp_path):
    incomplete = tmp_path / "ckpt" / "0000-0002"
    incomplete.mkdir(parents=True)
    (incomplete / "0.ckpt").write_bytes(b"")
    trainer = Trainer(gpt_args(tmp_path, "dp", 1, 1, **{"checkpoint.resume_from": str(incomplete)}))
    with pytest.raises(CheckpointError, match=f"checkpoint {incomplete} is incomplete"):
        trainer.run()
    result = _cli(
        gpt_args(tmp_path, "dp", 1, 1, **{"checkpoint.resume_from": str(tmp_path / "nope")}), tmp_path
    )
    assert (
        result.returncode == 2
        and f"checkpoint.resume_from: {tmp_path / 'nope'} does not exist" in result.stderr
    )


def test_incompatible_model_checkpoint_fails_fast(tmp_path):
    Trainer(gpt_args(tmp_path, "dp", 1, 1, max_train_steps=2)).run()
    bigger = {"model.args.config.n_embd": 48, "checkpoint.resume_from": "last", "max_train_steps": 4}
    argv = gpt_args(tmp_path, "dp", 1, 1, **bigger, gen_savedir=str(tmp_path / "gen2"))
    before = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    with pytest.raises(
        CheckpointError, match=f"checkpoint {tmp_path / 'ckpt' / 'last'} does not fit this model"
    ):
        Trainer(argv).run()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == before


def test_keep_last_n_and_best(tmp_path):
    t = Trainer(
        gpt_args(
            tmp_path,
            "dp",
            1,
            1,
            max_train_steps=4,
            **{"checkpoint.every_n_train_steps": 1, "checkpoint.keep_last_n_checkpoints": 2},
        )
    )
    t.run()
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["0000-0003", "0000-0004", "best", "last"]
    assert (
        os.readlink(tmp_path / "ckpt" / "best" / "0.ckpt") == "../0000-0004/0.ckpt"
    )  # the loss keeps falling


def test_a_tied_loss_moves_best_to_the_newer_step(tmp_path):
    # lr 0 and one batch per epoch: every step's loss is the same; as in nnScaler 0.8, `best` follows ties
    overrides = {"checkpoint.every_n_train_steps": 1, "optimizer.args.lr": 0.0, "dataset.train_args.size": 4}
    t = Trainer(gpt_args(tmp_path, "dp", 1, 1, max_train_steps=3, lr_scheduler=None, **overrides))
    t.run()
    assert len(set(t.losses)) == 1 and len(t.losses) == 3
    assert os.readlink(tmp_path / "ckpt" / "best" / "0.ckpt") == "../0002-0003/0.ckpt"


def test_a_fresh_run_moves_earlier_checkpoints_aside(tmp_path, capsys):
    Trainer(gpt_args(tmp_path, "dp", 1, 1, max_train_steps=2)).run()
    save_dir = tmp_path / "ckpt"
    before = {p.relative_to(save_dir): p.read_bytes() for p in save_dir.rglob("*.ckpt")}
    capsys.readouterr()
    Trainer(gpt_args(tmp_path, "dp", 1, 1, max_train_steps=2)).run()  # afresh: no longer refused
    (archived,) = (save_dir / "earlier_runs").iterdir()
    assert f"nnscaler-train: this run starts afresh: the earlier run's checkpoints moved to {archived}" in (
        capsys.readouterr().out
    )
    assert {p.relative_to(archived): p.read_bytes() for p in archived.rglob("*.ckpt")} == before
    assert os.readlink(save_dir / "last" / "0.ckpt") == "../0000-0002/0.ckpt"


def test_copies_instead_of_symlinks_and_resume_from_best(tmp_path):
    copies = {
        "checkpoint.every_n_train_steps": 1,
        "checkpoint.symlink_best_and_last": "false",
        "max_train_steps": 2,
    }
    Trainer(gpt_args(tmp_path, "dp", 1, 1, **copies)).run()
    last, best = tmp_path / "ckpt" / "last", tmp_path / "ckpt" / "best"
    assert not last.is_symlink() and (last / "complete.json").exists()
    assert not any(f.is_symlink() for f in last.iterdir())  # copies, not links
    assert json.loads((last / "complete.json").read_text())["step"] == 2
    resumed = Trainer(
        gpt_args(tmp_path, "dp", 1, 1, **{**copies, "max_train_steps": 3, "checkpoint.resume_from": "best"})
    )
    resumed.run()
    assert resumed.train_status["step"] == 3 and len(resumed.losses) == 1
    assert json.loads((last / "complete.json").read_text())["step"] == 3 and best.is_dir()
