"""`save_pretrained` writes only its own files into the user's directory (issue 41).

The export's files (safetensors, index, config.json) go into the directory one by one, atomically;
the user's tokenizer, README and training checkpoints beside them survive byte-identical; shards of
an earlier export go only when the index nnscaler wrote named them; a path that is a file is refused;
config.json states the dtype written; a damaged safetensors file is named when loading.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from nnscaler.errors import CheckpointError
from nnscaler.integration.hf import load_pretrained, save_pretrained
from tests.integration import hf_case as H
from tests.writers.common import assert_kept, plant

INDEX = "model.safetensors.index.json"


def _shards(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("model-*.safetensors"))


def _loads_as(directory: Path, model: torch.nn.Module) -> None:
    from transformers import Qwen2ForCausalLM

    back = Qwen2ForCausalLM.from_pretrained(directory).state_dict()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(back[k], v, rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("shard", ["5GB", "40KB"], ids=["one_file", "sharded"])
def test_export_keeps_the_users_files(tmp_path, shard):
    model = H.build_qwen2(H.SOURCE_SEED)
    out = tmp_path / "out"
    kept = plant(out)
    save_pretrained(model, out, max_shard_size=shard)
    assert_kept(out, kept)
    assert (out / "config.json").is_file()
    assert (out / INDEX).is_file() == (shard == "40KB")
    _loads_as(out, model)
    assert not [p for p in os.listdir(out) if ".tmp-" in p]  # no temporary file left


def test_reexport_removes_only_what_its_index_named(tmp_path):
    out = tmp_path / "out"
    first, second = H.build_qwen2(H.SOURCE_SEED), H.build_qwen2(H.OTHER_SEED)
    save_pretrained(first, out, max_shard_size="40KB")
    old = _shards(out)
    assert len(old) > 2
    kept = plant(out, {"model-extra.safetensors": b"the user's own file", "notes.md": b"x"})
    save_pretrained(second, out, max_shard_size="80KB")  # fewer shards; names that collide are not reused
    new = sorted(json.loads((out / INDEX).read_text())["weight_map"].values())
    assert _shards(out) == sorted(set(new)) + ["model-extra.safetensors"]
    assert not set(old) & set(new)
    assert_kept(out, kept)
    _loads_as(out, second)
    save_pretrained(first, out)  # one file: the index nnscaler wrote and its shards go
    assert not (out / INDEX).exists() and _shards(out) == ["model-extra.safetensors"]
    assert_kept(out, kept)
    _loads_as(out, first)
    save_pretrained(second, out, max_shard_size="40KB")  # back to shards: our model.safetensors goes
    assert not (out / "model.safetensors").exists()
    _loads_as(out, second)


def test_foreign_files_are_never_deleted(tmp_path):
    """An export by transformers in the directory: its shards stay (not named by an index of ours),
    and its single model.safetensors, which transformers would read first, is refused, not deleted."""
    out = tmp_path / "out"
    theirs, ours = H.build_qwen2(H.SOURCE_SEED), H.build_qwen2(H.OTHER_SEED)
    theirs.save_pretrained(out, max_shard_size="40KB")
    foreign = {p.name: p.read_bytes() for p in out.glob("model-*.safetensors")}
    save_pretrained(ours, out, max_shard_size="40KB")
    assert_kept(out, foreign)
    _loads_as(out, ours)

    single = tmp_path / "single"
    theirs.save_pretrained(single)
    before = (single / "model.safetensors").read_bytes()
    with pytest.raises(CheckpointError, match="model.safetensors was not written by nnscaler"):
        save_pretrained(ours, single, max_shard_size="40KB")
    assert (single / "model.safetensors").read_bytes() == before
    assert not _shards(single)


def test_path_that_is_a_file_is_refused(tmp_path):
    target = tmp_path / "model_out"
    target.write_bytes(b"a file of the user's")
    with pytest.raises(CheckpointError, match=str(target)):
        save_pretrained(H.build_qwen2(H.SOURCE_SEED), target)
    assert target.read_bytes() == b"a file of the user's"
    assert sorted(os.listdir(tmp_path)) == ["model_out"]


def test_config_states_the_dtype_written(tmp_path):
    """An fp16 checkpoint loaded into an fp32 module exports fp32 tensors, and says so."""
    from transformers import Qwen2ForCausalLM

    H.build_qwen2(H.SOURCE_SEED).half().save_pretrained(tmp_path / "fp16")
    assert json.loads((tmp_path / "fp16" / "config.json").read_text())["dtype"] == "float16"
    model = H.build_qwen2(H.OTHER_SEED)  # float32
    load_pretrained(model, tmp_path / "fp16")
    save_pretrained(model, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float32"
    back = Qwen2ForCausalLM.from_pretrained(tmp_path / "out")
    assert back.dtype == torch.float32
    save_pretrained(model, tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("shard", ["5GB", "40KB"], ids=["one_file", "sharded"])
def test_truncated_safetensors_is_named(tmp_path, shard):
    out = tmp_path / "out"
    save_pretrained(H.build_qwen2(H.SOURCE_SEED), out, max_shard_size=shard)
    victim = sorted(out.glob("model*.safetensors"))[-1]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=str(victim)) as info:
        load_pretrained(H.build_qwen2(H.OTHER_SEED), out)
    assert "truncated" in str(info.value)


def test_damaged_config_and_index_are_named(tmp_path):
    out = tmp_path / "out"
    save_pretrained(H.build_qwen2(H.SOURCE_SEED), out, max_shard_size="40KB")
    index = (out / INDEX).read_text()
    (out / INDEX).write_text(index[: len(index) // 2])
    with pytest.raises(CheckpointError, match=str(out / INDEX)):
        load_pretrained(H.build_qwen2(H.OTHER_SEED), out)
    (out / INDEX).write_text(index)
    (out / "config.json").write_text('{"model_type": "qw')
    with pytest.raises(CheckpointError, match=str(out / "config.json")):
        load_pretrained(H.build_qwen2(H.OTHER_SEED), out)


def test_two_ranks_keep_the_users_files_and_refuse_a_file(tmp_path):
    from tests.dist_util import spawn
    from tests.writers import workers

    out, blocked = tmp_path / "out", tmp_path / "blocked"
    kept = plant(out)
    blocked.write_bytes(b"x")
    messages = spawn(workers.hf_export_worker, 2, tmp_path, str(out), str(blocked))
    assert_kept(out, kept)
    _loads_as(out, H.build_qwen2(H.SOURCE_SEED))
    assert all(str(blocked) in m[0] for m in messages), messages
    assert blocked.read_bytes() == b"x"


def test_a_failed_export_leaves_the_previous_one_and_no_new_shard(tmp_path, monkeypatch):
    import nnscaler.integration.hf.export_files as ef

    out = tmp_path / "out"
    first = H.build_qwen2(H.SOURCE_SEED)
    save_pretrained(first, out, max_shard_size="40KB")
    before = sorted(os.listdir(out))
    kept = plant(out)
    calls = []
    real = ef._write_safetensors

    def failing(target, tensors):
        calls.append(target)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        real(target, tensors)

    monkeypatch.setattr(ef, "_write_safetensors", failing)
    with pytest.raises(OSError, match="No space left"):
        save_pretrained(H.build_qwen2(H.OTHER_SEED), out, max_shard_size="40KB")
    assert sorted(set(os.listdir(out)) - set(kept) - {"checkpoints", "notes"}) == before
    assert_kept(out, kept)
    _loads_as(out, first)
