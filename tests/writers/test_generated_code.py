"""Generated code and merged checkpoints write only their own files (issue 41).

`parallelize` regenerates into its output directory: gencode files of ranks the new config lacks go,
every other file (`notes.txt`, `gencode_old.py`, a folder) stays byte-identical. The broadcast of
generated files to other machines sends and removes only nnscaler's names. The merged-checkpoint
writers (Lightning, nnScaler 0.8's `merge_checkpoints`) write their one file beside the user's.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from nnscaler import ComputeConfig, parallelize
from nnscaler.parallel import module_outdir
from nnscaler.runtime.checkpoint.files import load_file
from tests.dist_util import spawn
from tests.writers import workers
from tests.writers.common import assert_kept, plant


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))).sum()


def _x() -> dict:
    return {"x": torch.randn(4, 8, generator=torch.Generator().manual_seed(1))}


def _compile(save: Path, reuse: str = "override") -> nn.Module:
    torch.manual_seed(0)
    return parallelize(
        Tiny(), _x(), "dp", ComputeConfig(1, 1), gen_savedir=save, reuse=reuse, load_module=True
    )


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> tuple[Path, nn.Module]:
    save = tmp_path_factory.mktemp("gen")
    return save, _compile(save)


def test_regenerating_keeps_the_users_files(compiled):
    save, _ = compiled
    outdir = module_outdir(save, Tiny, None)
    kept = plant(
        outdir, {"notes.txt": b"why this plan", "gencode_old.py": b"# my copy\n", "data/x.bin": b"\0\1"}
    )
    (outdir / "gencode3.py").write_text("# code of rank 3 of an earlier compile on 4 ranks\n")
    pm = _compile(save)
    assert_kept(outdir, kept)
    assert not (outdir / "gencode3.py").exists()  # nnscaler's own, for a rank this config lacks
    torch.manual_seed(0)
    torch.testing.assert_close(pm(**_x()), Tiny()(**_x()))
    _compile(save, reuse="match")  # the user's files do not make the record mismatch
    assert_kept(outdir, kept)


def test_broadcast_sends_and_removes_only_generated_files(tmp_path):
    code, plan = b"# gencode of rank 0\n", b'{"plan": 0}'
    plant(tmp_path / "machine0", {"gencode0.py": code, "plan.json": plan, "notes0.txt": b"rank 0's notes"})
    kept = plant(tmp_path / "machine1", {"notes.txt": b"machine 1's notes", "gencode_old.py": b"# mine"})
    (tmp_path / "machine1" / "gencode5.py").write_text("# stale: rank 5 of an earlier compile\n")
    listings = spawn(workers.broadcast_worker, 2, tmp_path, str(tmp_path))
    assert_kept(tmp_path / "machine1", kept)
    assert listings[1] == ["gencode0.py", "gencode_old.py", "notes.txt", "plan.json"]
    assert (tmp_path / "machine1" / "gencode0.py").read_bytes() == code


def test_merged_checkpoints_write_beside_the_users_files(compiled, tmp_path):
    from nnscaler.integration.lightning.pytorch.checkpoint import merge_checkpoint_files
    from nnscaler.runtime.module import ParallelModule

    _, pm = compiled
    state = pm.state_dict()
    kept = plant(tmp_path, {"README.md": b"merged here", "old/full.ckpt": b"an older merge of mine"})
    torch.save({"state_dict": state, "optimizer_states": [], "epoch": 3}, tmp_path / "rank0.ckpt")
    merge_checkpoint_files([tmp_path / "rank0.ckpt"], tmp_path / "full.ckpt")
    torch.save({"state_dict": state, "optim_state_dict": None}, tmp_path / "dist-0.ckpt")
    merged = ParallelModule.merge_checkpoints(str(tmp_path / "dist"))
    assert_kept(tmp_path, kept)
    names = {"README.md", "old", "rank0.ckpt", "dist-0.ckpt", "full.ckpt", os.path.basename(merged)}
    assert set(os.listdir(tmp_path)) == names
    assert set(load_file(tmp_path / "full.ckpt")["state_dict"]) == {
        "fc1.weight",
        "fc1.bias",
        "fc2.weight",
        "fc2.bias",
    }
    assert set(load_file(merged)["state_dict"]) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}


def test_a_truncated_generated_weights_file_is_named(compiled, tmp_path):
    from nnscaler.errors import CheckpointError
    from nnscaler.parallel.savedir import WEIGHTS_FILE

    _, pm = compiled
    weights = tmp_path / WEIGHTS_FILE  # the full weights a generated module loads its shards from
    torch.save(Tiny().state_dict(), weights)
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"fullmodel\.pt cannot be read.*generate the code again"):
        type(pm)._load_relative(str(weights))


def test_a_truncated_tracing_state_dict_is_named(tmp_path):
    from nnscaler.cli.tracing_weights import load_model_weights
    from nnscaler.errors import ConfigError

    path = tmp_path / "weights.pt"
    torch.save(Tiny().state_dict(), path)
    path.write_bytes(path.read_bytes()[:-200])
    args = SimpleNamespace(tracing_from_weights=str(path))
    with pytest.raises(ConfigError, match=r"tracing_from_weights.*weights\.pt.*truncated.*torch\.save"):
        load_model_weights(args, Tiny())
