"""Checkpoint directories replace only what nnscaler wrote in them (issue 41).

`write_rank_dir` (the CLI Trainer's and the Lightning strategy's writer) renames a finished temporary
directory over the previous checkpoint. Files a user put into that directory (a README, notes/, a
checkpoint of their own) are carried into the new one byte-identical; files of the earlier save
(`3.ckpt` of a run on more ranks) go with it. A checkpoint path that is a file is refused on every
rank. Loaders name a truncated file and say what to do.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from nnscaler.errors import CheckpointError
from nnscaler.runtime.checkpoint.files import load_file, write_rank_dir
from tests.dist_util import spawn
from tests.writers import workers
from tests.writers.common import assert_kept, plant

USER = {"README.md": b"# run 7\n", "notes/eval.txt": b"ppl 12.3\n", "mine.ckpt": b"not nnscaler's"}


def _write(final: Path, files: dict) -> Path:
    return write_rank_dir(final, final.with_name(".tmp"), final.with_name(".old"), 0, files)


def test_replacing_a_checkpoint_keeps_the_users_files(tmp_path):
    final = tmp_path / "last"
    _write(final, {"0.ckpt": {"w": torch.zeros(2)}, "1.ckpt": {}, "3.ckpt": {}})  # an earlier run, 4 ranks
    kept = plant(final, USER)
    os.symlink("README.md", final / "readme-link")
    _write(final, {"0.ckpt": {"w": torch.ones(2)}})
    assert_kept(final, kept)
    assert os.readlink(final / "readme-link") == "README.md"
    assert sorted(p.name for p in final.glob("*.ckpt")) == ["0.ckpt", "mine.ckpt"]  # 1, 3: the earlier save's
    torch.testing.assert_close(load_file(final / "0.ckpt")["w"], torch.ones(2))
    assert not (tmp_path / ".tmp").exists() and not (tmp_path / ".old").exists()


def test_trainer_checkpoint_dir_keeps_the_users_files(tmp_path):
    from nnscaler.cli.checkpoint import COMPLETE_FILE, write_checkpoint_dir

    save = tmp_path / "ckpts"
    write_checkpoint_dir(save, "0-10", 0, {"0.ckpt": {"step": 10}}, {"world_size": 1})
    kept = plant(save / "0-10", USER)
    write_checkpoint_dir(save, "0-10", 0, {"0.ckpt": {"step": 11}}, {"world_size": 1})
    assert_kept(save / "0-10", kept)
    assert (save / "0-10" / COMPLETE_FILE).is_file()
    assert load_file(save / "0-10" / "0.ckpt")["step"] == 11


def test_pruning_deletes_only_the_trainers_files(tmp_path, caplog):
    from nnscaler.cli.checkpoint import COMPLETE_FILE, prune, step_dirs, write_checkpoint_dir

    save = tmp_path / "ckpts"
    for step in (10, 20, 30):
        write_checkpoint_dir(save, f"0-{step}", 0, {"0.ckpt": {}, "1.ckpt": {}}, {"world_size": 2})
    kept = plant(save / "0-10", USER)
    with caplog.at_level("WARNING", logger="nnscaler.cli.checkpoint"):
        prune(save, keep=1)
    assert_kept(save / "0-10", kept)
    assert not (save / "0-10" / COMPLETE_FILE).exists() and not list((save / "0-10").glob("[0-9].ckpt"))
    assert not (save / "0-20").exists()  # nothing of the user's in it: removed whole
    assert step_dirs(save) == [save / "0-30"]
    assert "0-10" in caplog.text and "README.md" in caplog.text and "notes" in caplog.text


def test_a_damaged_complete_json_is_named(tmp_path):
    from nnscaler.cli.checkpoint import COMPLETE_FILE, checkpoint_info, write_checkpoint_dir

    final = write_checkpoint_dir(tmp_path, "0-10", 0, {"0.ckpt": {}}, {"world_size": 1})
    (final / COMPLETE_FILE).write_text('{"world_si')
    with pytest.raises(CheckpointError, match=r"0-10/complete\.json cannot be read.*earlier checkpoint"):
        checkpoint_info(final)


def test_lightning_checkpoint_keeps_the_users_files(tmp_path):
    from nnscaler.integration.lightning.pytorch.checkpoint import read_rank_checkpoint, write_rank_checkpoint

    ckpt = tmp_path / "epoch=0-step=4.ckpt"
    write_rank_checkpoint({"state_dict": {"w": torch.zeros(2)}, "epoch": 0}, ckpt, 0)
    kept = plant(ckpt, {"README.md": b"lightning run\n", "notes/a.txt": b"a"})
    write_rank_checkpoint({"state_dict": {"w": torch.ones(2)}, "epoch": 1}, ckpt, 0)
    assert_kept(ckpt, kept)
    assert read_rank_checkpoint(ckpt, 0, 1)["epoch"] == 1  # one rank file: nothing stale carried over


def test_lightning_remove_checkpoint_keeps_the_users_files(tmp_path):
    """ModelCheckpoint beyond save_top_k removes a checkpoint: its rank files go, the user's stay."""
    from types import SimpleNamespace

    from nnscaler.integration.lightning.pytorch.checkpoint import write_rank_checkpoint
    from nnscaler.integration.lightning.pytorch.strategy import NnScalerStrategy

    ckpt, plain = tmp_path / "epoch=0-step=4.ckpt", tmp_path / "epoch=0-step=8.ckpt"
    for d in (ckpt, plain):
        write_rank_checkpoint({"state_dict": {}, "epoch": 0}, d, 0)
    kept = plant(ckpt, {"README.md": b"best so far\n"})
    for d in (ckpt, plain):
        NnScalerStrategy.remove_checkpoint(SimpleNamespace(is_global_zero=True), d)
    assert_kept(ckpt, kept)
    assert sorted(os.listdir(ckpt)) == ["README.md"]
    assert not plain.exists()  # nothing of the user's in it: removed whole


def test_checkpoint_path_that_is_a_file_is_refused(tmp_path):
    final = tmp_path / "last"
    final.write_bytes(b"the user's file")
    with pytest.raises(CheckpointError, match=str(final)):
        _write(final, {"0.ckpt": {}})
    assert final.read_bytes() == b"the user's file"
    assert sorted(os.listdir(tmp_path)) == ["last"]


def test_two_ranks_keep_the_users_files_and_refuse_a_file(tmp_path):
    final = tmp_path / "ck" / "last"
    final.mkdir(parents=True)
    kept = plant(final, USER)
    spawn(workers.rank_dir_worker, 2, tmp_path, str(final))
    assert_kept(final, kept)
    assert [load_file(final / f"{r}.ckpt")["step"] for r in (0, 1)] == [2, 2]
    blocked = tmp_path / "blocked"
    blocked.write_bytes(b"x")
    messages = spawn(workers.refused_worker, 2, tmp_path, str(blocked))
    assert all(str(blocked) in m for m in messages), messages
    assert blocked.read_bytes() == b"x"


@pytest.mark.parametrize("who", ["runtime", "lightning", "compat"])
def test_truncated_checkpoint_file_is_named(tmp_path, who):
    path = tmp_path / ("dist_checkpoint-0.ckpt" if who == "compat" else "rank0.ckpt")
    torch.save({"state_dict": {"w": torch.randn(64, 64)}, "optim_state_dict": None}, path)
    path.write_bytes(path.read_bytes()[:2000])
    with pytest.raises(CheckpointError, match=str(path)) as info:
        if who == "runtime":
            load_file(path)
        elif who == "lightning":
            from nnscaler.integration.lightning.pytorch.checkpoint import read_rank_checkpoint

            read_rank_checkpoint(tmp_path, 0, 1)
        else:
            from nnscaler.runtime.module import ParallelModule

            ParallelModule.merge_checkpoints(str(tmp_path / "dist_checkpoint"))
    assert "earlier checkpoint" in str(info.value)
