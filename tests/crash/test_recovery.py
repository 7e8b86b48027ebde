"""What an interrupted Trainer save leaves, put right and reported (nnscaler.cli.checkpoint_recovery),
for the states no kill point reaches where directories are swapped atomically (Linux renameat2):
killed between the two renames that replace an existing step directory."""

from __future__ import annotations

import json
import logging
import os

import pytest

from nnscaler.cli.checkpoint import point, prune, recover_save_dir, step_dirs


def _step(save_dir, name, step, complete=True):
    d = save_dir / name
    d.mkdir(parents=True)
    (d / "0.ckpt").write_text(f"step {step}")
    if complete:
        (d / "complete.json").write_text(json.dumps({"step": step}))
    return d


@pytest.mark.parametrize("finished", [True, False])
def test_a_swap_interrupted_between_its_renames_is_finished_or_undone(tmp_path, caplog, finished):
    # `0000-0004` was being replaced: renamed to `.tmp-old-0000-0004`, the new one not yet renamed in
    _step(tmp_path, ".tmp-old-0000-0004", 4)
    _step(tmp_path, ".tmp-0000-0004", 5, complete=finished)
    with caplog.at_level(logging.WARNING, "nnscaler.cli.checkpoint"):
        found = recover_save_dir(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["0000-0004"]
    assert (tmp_path / "0000-0004" / "0.ckpt").read_text() == ("step 5" if finished else "step 4")
    assert ".tmp-0000-0004" in caplog.text and ".tmp-old-0000-0004" in caplog.text and len(found) == 3


def test_pointers_half_swapped_and_prunes_half_done_are_reported(tmp_path, caplog):
    old, new = _step(tmp_path, "0000-0002", 2), _step(tmp_path, "0000-0004", 4)
    point(tmp_path, "last", old)
    os.replace(tmp_path / "last", tmp_path / ".last.old")  # killed inside point(): between the renames
    point(tmp_path, "best", new)
    os.rename(tmp_path / "best", tmp_path / ".best.new")
    _step(tmp_path, ".pruned-0000-0001", 1)
    _step(tmp_path, "0000-0006", 6)  # complete, newer than `last`
    with caplog.at_level(logging.WARNING, "nnscaler.cli.checkpoint"):
        recover_save_dir(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["0000-0002", "0000-0004", "0000-0006", "best", "last"]
    assert os.readlink(tmp_path / "last" / "0.ckpt") == "../0000-0002/0.ckpt"
    assert os.readlink(tmp_path / "best" / "0.ckpt") == "../0000-0004/0.ckpt"
    for name in (
        ".last.old",
        ".best.new",
        ".pruned-0000-0001",
        "`last` -> 0000-0002",
        "0000-0006 is complete",
    ):
        assert name in caplog.text, name
    caplog.clear()
    assert recover_save_dir(tmp_path) == [] and not caplog.text  # nothing left: nothing said


def test_prune_renames_before_it_deletes(tmp_path, monkeypatch):
    for k in (1, 2, 3):
        _step(tmp_path, f"0000-000{k}", k)
    point(tmp_path, "last", tmp_path / "0000-0003")
    seen = []
    monkeypatch.setattr("shutil.rmtree", lambda path, **kw: seen.append(os.path.basename(path)))
    prune(tmp_path, 1)  # the deletes "crash": nothing is deleted
    assert seen == [".pruned-0000-0001", ".pruned-0000-0002"]
    assert [d.name for d in step_dirs(tmp_path)] == ["0000-0003"]  # never a step directory missing files
