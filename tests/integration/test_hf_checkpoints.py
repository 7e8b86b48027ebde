"""Hugging Face checkpoints in and out (nnscaler.integration.hf), on real gloo ranks.

A tiny Qwen2 saved by transformers' `save_pretrained` in several safetensors shards is loaded into a
freshly built (differently seeded) parallel module with `load_pretrained`, trained with SGD, written
with our `save_pretrained`, read back by transformers' `from_pretrained` and compared with one process
trained the same way from the same checkpoint. Each rank's bytes read are checked against its share.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.dist_util import spawn
from tests.integration import hf_case as H


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """The pretrained checkpoint: transformers' own sharded save (several files and an index)."""
    path = tmp_path_factory.mktemp("hf") / "src"
    H.build_qwen2(H.SOURCE_SEED).save_pretrained(path, max_shard_size="40KB")
    return path


def _checkpoint_bytes(path: Path) -> int:
    return json.loads((path / "model.safetensors.index.json").read_text())["metadata"]["total_size"]


def _bad_checkpoints(source: Path, root: Path) -> dict[str, str]:
    """Checkpoints that must be refused: a renamed tensor, a wrong shape, a prefix that matches nothing."""
    from transformers import Qwen2ForCausalLM

    sd = {k: v.contiguous() for k, v in Qwen2ForCausalLM.from_pretrained(source).state_dict().items()}
    sd.pop("lm_head.weight")  # tied: stored once, as transformers does
    renamed = dict(sd)
    renamed["model.norm.scale"] = renamed.pop("model.norm.weight")
    shape = dict(sd)
    shape["model.layers.1.mlp.up_proj.weight"] = torch.zeros(64, 64)
    out = {}
    for name, tensors in {
        "renamed": renamed,
        "shape": shape,
        "prefixed": {"x." + k: v for k, v in sd.items()},
    }.items():
        (root / name).mkdir()
        save_file(tensors, str(root / name / "model.safetensors"), metadata={"format": "pt"})
        out[name] = str(root / name)
    return out


def _assert_like_reference(out: Path, results: list[dict], ref_losses: list[float], ref) -> None:
    from transformers import Qwen2ForCausalLM

    for r in results:
        torch.testing.assert_close(r["losses"], ref_losses, rtol=1e-5, atol=1e-6)
    got = Qwen2ForCausalLM.from_pretrained(out)
    want = ref.state_dict()
    for name, value in got.state_dict().items():
        torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("world,wrapped", [(2, False), (4, True)], ids=["tp2", "tp4-prefix"])
def test_tp_round_trip_reads_only_each_share(world, wrapped, source, tmp_path):
    bad = _bad_checkpoints(source, tmp_path) if world == 2 else {}
    case = dict(
        src=str(source),
        out=str(tmp_path / "out"),
        gen=str(tmp_path / "gen"),
        plan=world,
        steps=3,
        wrapped=wrapped,
        pass_config=wrapped,
        bad=bad,
    )
    results = spawn(H.parallel_worker, world, tmp_path, case)
    ref_losses, ref = H.train_reference(str(source), 3)
    _assert_like_reference(tmp_path / "out", results, ref_losses, ref)
    out_files = sorted(os.listdir(tmp_path / "out"))
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".out.")]  # the temporary directory is gone
    assert "config.json" in out_files and "model.safetensors.index.json" in out_files
    assert sum(f.endswith(".safetensors") for f in out_files) > 2
    total = _checkpoint_bytes(source)
    for r in results:
        # both counts agree, and each rank read exactly its shard of every tensor (norms replicated)
        assert r["bytes_read"] == r["read_by_wrapper"] == r["share"], r
        assert r["share"] < total / world * 1.1
        print(f"tp{world}: rank read {r['bytes_read']} of {total} bytes")
        assert r["missing"] == [] and r["unexpected"] == []
    if bad:
        errors = results[0]["errors"]
        assert all(e == r["errors"][k] for r in results for k, e in errors.items())  # same on every rank
        assert "missing keys ['model.norm.weight']" in errors["renamed"]
        assert "unexpected keys ['model.norm.scale']" in errors["renamed"]
        assert "shape mismatch" in errors["shape"] and "model.layers.1.mlp.up_proj.weight" in errors["shape"]
        assert "(64, 64)" in errors["shape"] and "(128, 64)" in errors["shape"]
        assert "none of the" in errors["prefixed"] and "prefix=" in errors["prefixed"]
        assert all(e.startswith("CheckpointError") for e in errors.values())


@pytest.mark.parametrize("stage", [2, 3], ids=["zero2", "zero3"])
def test_zero_loads_only_its_share(stage, source, tmp_path):
    """tp 2 x dp 2 under ZeRO, optimizer built first: under ZeRO-3 each rank reads about its quarter."""
    case = dict(
        src=str(source),
        out=str(tmp_path / "out"),
        gen=str(tmp_path / "gen"),
        plan=2,
        steps=1,
        config={"use_zero": True, "zero_stage": stage},
        optimizer_first=True,
    )
    results = spawn(H.parallel_worker, 4, tmp_path, case)
    ref_losses, ref = H.train_reference(str(source), 1)
    _assert_like_reference(tmp_path / "out", results, ref_losses, ref)
    for r in results:
        assert r["bytes_read"] == r["read_by_wrapper"]
        if stage < 3:  # parameters whole on every replica: the tensor-parallel share
            assert r["bytes_read"] == r["tp_share"]
            continue
        # its slice of the flat buffers, plus at most the partial rows at a slice's two ends
        assert r["share"] <= r["bytes_read"] <= r["share"] + r["rows_slack"], r
        assert r["bytes_read"] < 0.6 * r["tp_share"]
        print(
            f"zero3 tp2xdp2: rank read {r['bytes_read']} (flat share {r['share']}, tp share {r['tp_share']})"
        )


def test_pipeline_stages_read_their_own_layers(source, tmp_path):
    case = dict(
        src=str(source),
        out=str(tmp_path / "out"),
        gen=str(tmp_path / "gen"),
        plan=2,
        steps=1,
        policy="pp",
        nmicros=2,
        config={"use_end2end": True, "pas_config": {"pipeline_nmicros": 2}},
    )
    results = spawn(H.parallel_worker, 2, tmp_path, case)
    ref_losses, ref = H.train_reference_micro(str(source), 1, 2)
    _assert_like_reference(tmp_path / "out", results, ref_losses, ref)
    total = _checkpoint_bytes(source)
    embedding = H.VOCAB * 64 * 4  # tied: the first stage embeds, the last projects with it
    for r in results:
        assert r["bytes_read"] == r["read_by_wrapper"] == r["share"] < total, r
    assert sum(r["bytes_read"] for r in results) == total + embedding


def test_trainer_yaml_loads_and_exports(source, tmp_path):
    steps, micro = 2, 2
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(H.trainer_yaml(str(tmp_path), str(source), str(tmp_path / "out"), steps, micro))
    results = spawn(H.trainer_worker, 2, tmp_path, str(cfg))
    ref_losses, ref = H.train_reference_samples(str(source), steps, micro)
    _assert_like_reference(tmp_path / "out", [{"losses": r} for r in results], ref_losses, ref)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["tie_word_embeddings"] is True


def test_plain_module_single_file_and_strict_false(tmp_path):
    """Without a process group on a plain module: one model.safetensors each way; strict=False."""
    from transformers import Qwen2ForCausalLM

    from nnscaler.integration.hf import load_pretrained, save_pretrained
    from nnscaler.integration.hf.save import parse_size

    assert parse_size("40KB") == 40_000 and parse_size("1MiB") == 2**20 and parse_size(7) == 7
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size("lots")
    src = H.build_qwen2(H.SOURCE_SEED)
    src.save_pretrained(tmp_path / "single")  # one file, no index
    assert not (tmp_path / "single" / "model.safetensors.index.json").exists()
    model = H.build_qwen2(H.OTHER_SEED)
    result = load_pretrained(model, tmp_path / "single")
    assert result.bytes_read == _checkpoint_bytes_of(tmp_path / "single")
    save_pretrained(model, tmp_path / "out")  # config found on the module (and the loaded config.json)
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
    back = Qwen2ForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    for name, value in src.state_dict().items():
        assert torch.equal(back[name], value), name
    sd = {k: v for k, v in src.state_dict().items() if k not in ("lm_head.weight", "model.norm.weight")}
    sd["extra.weight"] = torch.zeros(3)
    (tmp_path / "partial").mkdir()
    save_file(sd, str(tmp_path / "partial" / "model.safetensors"))
    result = load_pretrained(H.build_qwen2(H.OTHER_SEED), tmp_path / "partial", strict=False)
    assert result.missing_keys == ["model.norm.weight"] and result.unexpected_keys == ["extra.weight"]


def _checkpoint_bytes_of(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return sum(f.get_tensor(k).numel() * 4 for k in f.keys())
