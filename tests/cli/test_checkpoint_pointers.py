"""`last` / `best` as nnScaler 0.8 writes them (directories of relative links, one per file of the step),
recovery from a crash between the renames that swap a pointer in, checkpoints of the earlier layout
(`last` a symlink to the step), and a fresh run moving an earlier run into `earlier_runs/`."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

import nnscaler.cli.checkpoint as ck
from nnscaler.cli import Trainer
from tests.cli.common import gpt_args

STEPS = {"checkpoint.every_n_train_steps": 2}


def _run(tmp_path: Path, steps: int, **extra: object) -> Trainer:
    trainer = Trainer(gpt_args(tmp_path, "dp", 1, 1, max_train_steps=steps, **STEPS, **extra))
    trainer.run()
    return trainer


def _links(pointer: Path) -> dict[str, str]:
    return {f.name: os.readlink(f) for f in pointer.iterdir()}


def _fake_step(save_dir: Path, name: str, ranks: int = 2) -> Path:
    """A complete step directory with `ranks` rank files (no training needed)."""
    step = save_dir / name
    step.mkdir(parents=True)
    for r in range(ranks):
        (step / f"{r}.ckpt").write_bytes(f"{name} rank {r}".encode())
    (step / ck.COMPLETE_FILE).write_text("{}")
    return step


def test_pointer_is_a_directory_of_relative_links_one_per_file(tmp_path):
    save_dir = tmp_path / "ckpt"
    step = _fake_step(save_dir, "0000-0025", ranks=4)
    (step / "extra.json").write_text("{}")  # any other file of the step is linked too
    ck.point(save_dir, "last", step)
    last = save_dir / "last"
    assert last.is_dir() and not last.is_symlink()
    assert _links(last) == {f.name: f"../0000-0025/{f.name}" for f in step.iterdir()}
    assert len(list(save_dir.glob("**/*.ckpt"))) == 8  # 0.8's count: the step's files and last's links
    assert ck.pointer_target(last) == step.resolve()
    assert sorted(p.name for p in save_dir.iterdir()) == ["0000-0025", "last"]  # no leftovers
    ck.point(save_dir, "last", _fake_step(save_dir, "0000-0050", ranks=4))
    assert (last / "3.ckpt").read_bytes() == b"0000-0050 rank 3"


def test_trainer_writes_link_directories_and_resumes_from_them(tmp_path):
    _run(tmp_path, 4)
    save_dir = tmp_path / "ckpt"
    for name in ("last", "best"):
        assert not (save_dir / name).is_symlink()
        assert _links(save_dir / name) == {
            "0.ckpt": "../0000-0004/0.ckpt",
            "complete.json": "../0000-0004/complete.json",
        }
    assert len(list(save_dir.glob("**/*.ckpt"))) == 2 + 2  # steps 2 and 4, plus best and last
    resumed = _run(tmp_path, 6, **{"checkpoint.resume_from": "last"})
    assert resumed.losses and resumed.train_status["step"] == 6 and len(resumed.losses) == 2
    assert _links(save_dir / "last")["0.ckpt"] == "../0000-0006/0.ckpt"


def _crash(save_dir: Path, state: str) -> None:
    """Leave `last` as a crash between the renames of point() would (last -> 0000-0004 before)."""
    last, new, old = save_dir / "last", save_dir / ".last.new", save_dir / ".last.old"
    if state == "only old":
        os.replace(last, old)
    elif state == "only new":
        os.replace(last, new)
    else:  # both: the old pointer (step 2) renamed away, the new one (step 4) not yet renamed in
        os.replace(last, new)
        old.mkdir()
        for f in (save_dir / "0000-0002").iterdir():
            os.symlink(f"../0000-0002/{f.name}", old / f.name)
        if state == "both, new incomplete":
            (new / "0.ckpt").unlink()


@pytest.mark.parametrize(
    "state, resumed_at",
    [("only old", 4), ("only new", 4), ("both", 4), ("both, new incomplete", 2)],
)
def test_a_crash_between_the_renames_leaves_last_usable(tmp_path, state, resumed_at):
    _run(tmp_path, 4)
    save_dir = tmp_path / "ckpt"
    _crash(save_dir, state)
    assert not (save_dir / "last").exists()
    assert ck.pointer_target(ck.pointer_path(save_dir, "last")).name == f"0000-000{resumed_at}"
    ck.prune(save_dir, 1)  # keeps the step that the recovered pointer links into
    assert (save_dir / f"0000-000{resumed_at}" / "0.ckpt").is_file()
    resumed = _run(tmp_path, 6, **{"checkpoint.resume_from": "last"})
    assert len(resumed.losses) == 6 - resumed_at  # resumed from the recovered step, not afresh
    assert not (save_dir / "earlier_runs").exists()
    assert _links(save_dir / "last")["0.ckpt"] == "../0000-0006/0.ckpt"
    assert not (save_dir / ".last.new").exists() and not (save_dir / ".last.old").exists()


def test_merging_a_crashed_last_uses_the_recovered_pointer(tmp_path):
    _run(tmp_path, 2)
    save_dir = tmp_path / "ckpt"
    _crash(save_dir, "only new")
    Trainer.merge_checkpoint(str(save_dir / "last"), str(tmp_path / "merged.ckpt"))
    assert (tmp_path / "merged.ckpt").is_file()


def test_a_checkpoint_of_the_earlier_layout_still_resumes(tmp_path):
    _run(tmp_path, 4)
    save_dir = tmp_path / "ckpt"
    for name in ("last", "best"):  # as earlier versions wrote them: a symlink to the step
        shutil.rmtree(save_dir / name)
        os.symlink("0000-0004", save_dir / name)
    resumed = _run(tmp_path, 6, **{"checkpoint.resume_from": "last", "checkpoint.keep_last_n_checkpoints": 1})
    assert len(resumed.losses) == 2
    last = save_dir / "last"
    assert not last.is_symlink() and _links(last)["0.ckpt"] == "../0000-0006/0.ckpt"
    assert ck.pointer_target(save_dir / "best") in {
        (save_dir / "0000-0004").resolve(),
        (save_dir / "0000-0006").resolve(),
    }
    assert ck.pointer_target(save_dir / "best").is_dir()  # pruning kept the step that best links into


def test_prune_keeps_the_steps_that_last_and_best_link_into(tmp_path):
    save_dir = tmp_path / "ckpt"
    steps = [_fake_step(save_dir, f"0000-000{i}") for i in range(1, 6)]
    ck.point(save_dir, "best", steps[0])
    ck.point(save_dir, "last", steps[1])
    os.replace(save_dir / "last", save_dir / ".last.new")  # a crash between the renames
    ck.prune(save_dir, 1)
    assert [d.name for d in ck.step_dirs(save_dir)] == ["0000-0001", "0000-0002", "0000-0005"]
    assert (save_dir / "best" / "0.ckpt").read_bytes() == b"0000-0001 rank 0"


def test_a_fresh_run_moves_the_earlier_run_into_earlier_runs(tmp_path, caplog):
    first = _run(tmp_path, 4)
    save_dir = tmp_path / "ckpt"
    before = {p.relative_to(save_dir): p.read_bytes() for p in save_dir.rglob("*") if p.is_file()}
    with caplog.at_level(logging.WARNING, logger="nnscaler.cli.checkpoint"):
        second = _run(tmp_path, 2)  # starts afresh into the same save_dir
    (archived,) = (save_dir / "earlier_runs").iterdir()
    assert {p.relative_to(archived): p.read_bytes() for p in archived.rglob("*") if p.is_file()} == before
    assert (archived / "last").is_dir() and _links(archived / "last")["0.ckpt"] == "../0000-0004/0.ckpt"
    assert ck.pointer_target(archived / "last") == (archived / "0000-0004").resolve()
    assert any(str(archived) in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert [d.name for d in ck.step_dirs(save_dir)] == ["0000-0002"]
    assert ck.pointer_target(save_dir / "last") == (save_dir / "0000-0002").resolve()
    assert second.losses == first.losses[:2]  # a fresh run, not a resumed one
    resumed = _run(tmp_path, 4, **{"checkpoint.resume_from": "last"})
    assert resumed.losses == first.losses[2:]  # from the new run's step 2, bitwise as the first run
    assert len(list((save_dir / "earlier_runs").iterdir())) == 1  # resuming moves nothing
