"""NnScalerStrategy trains a LightningModule like Lightning's DDP and like one device (dp, tp, pp),
saves per-rank checkpoints that resume exactly and merge into the plain module's weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nnscaler.errors import ConfigError
from nnscaler.integration.lightning.pytorch import NnScalerPrecision, NnScalerStrategy
from tests.integration.lightning_case import Regressor, loader, reference_weights

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lightning")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += ["-m", "tests.integration.lightning_case", str(out)]
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out


def _merged(runs: Path, name: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{name}_merged.ckpt"
    NnScalerStrategy.merge_checkpoint([runs / f"{name}.ckpt"], out)
    return torch.load(out, weights_only=False)


def _close(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), (what, sorted(set(got) ^ set(want)))
    for k in want:
        torch.testing.assert_close(
            got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{what}: {k}: {m}"
        )


@pytest.mark.parametrize("name,replicas", [("dp", 2), ("tp", 1), ("pp", 1)])
def test_parity_with_one_device(runs, tmp_path, name, replicas):
    merged = _merged(runs, name, tmp_path)
    assert merged["global_step"] == 3
    _close(merged["state_dict"], reference_weights(3, replicas), f"{name} vs one device")
    plain = Regressor()
    plain.load_state_dict(merged["state_dict"])  # strict: the merged names are the module's own


def test_logged_values_reduce_over_replicas(runs):
    """sync_dist sums over data-parallel replicas only; the mean loss is the same for every plan."""
    got = {n: json.loads((runs / f"{n}_metrics.json").read_text()) for n in ("dp", "tp", "pp")}
    assert [got[n]["replicas"] for n in ("dp", "tp", "pp")] == [2.0, 1.0, 1.0]
    assert got["pp"]["train_loss"] == pytest.approx(got["tp"]["train_loss"], rel=1e-5)


def test_deduped_checkpoint_merges_to_the_same_state(runs, tmp_path):
    for name in ("dp", "tp"):
        sharded, deduped = _merged(runs, name, tmp_path), _merged(runs, f"{name}_deduped", tmp_path)
        _close(deduped["state_dict"], sharded["state_dict"], f"{name} deduped vs sharded")
        assert len(deduped["optimizer_states"]) == 1, name
        want, got = sharded["optimizer_states"][0], deduped["optimizer_states"][0]
        assert got["param_groups"] == want["param_groups"], name


def test_resume_from_deduped_equals_resume_from_sharded(runs, tmp_path):
    sharded, deduped = _merged(runs, "dp_resumed", tmp_path), _merged(runs, "dp_deduped_resumed", tmp_path)
    assert sharded["global_step"] == deduped["global_step"] == 4
    _close(deduped["state_dict"], sharded["state_dict"], "dp resumed from deduped vs sharded")
    moved = _merged(runs, "dp", tmp_path)["state_dict"]
    assert any(not torch.equal(moved[k], sharded["state_dict"][k]) for k in moved)  # it did train on


def test_dp_matches_lightning_ddp(runs, tmp_path):
    ddp = torch.load(runs / "ddp.ckpt", weights_only=False)["state_dict"]
    _close(_merged(runs, "dp", tmp_path)["state_dict"], ddp, "dp vs DDP")


def test_resume_continues_exactly(runs, tmp_path):
    files = sorted(p.name for p in (runs / "tp_step2.ckpt").iterdir())
    assert files == ["rank0.ckpt", "rank1.ckpt"]
    resumed = _merged(runs, "tp_resumed", tmp_path)
    assert resumed["global_step"] == 4
    straight = _merged(runs, "tp_straight", tmp_path)
    _close(straight["state_dict"], reference_weights(4, 1, steps_per_epoch=2), "4 tp steps vs one device")
    # Lightning counts the epoch a finished fit() ended in: the resumed run's next epoch is 2 (its
    # sampler reshuffles with seed 2), and from there the weights follow one device exactly
    ref = reference_weights(4, 1, steps_per_epoch=2, epochs=[0, 2])
    _close(resumed["state_dict"], ref, "resumed tp vs one device")
    merged_opt = resumed["optimizer_states"][0]
    assert merged_opt["param_groups"][0]["lr"] == pytest.approx(0.05)


def test_bad_arguments_are_named():
    from nnscaler import ComputeConfig

    with pytest.raises(ValueError, match="'64-true'.*'bf16-mixed'"):
        NnScalerPrecision("64-true")
    with pytest.raises(ConfigError, match="compute_config"):
        NnScalerStrategy(pas_policy="tp")
    with pytest.raises(ConfigError, match="state_dict_type='full'"):
        NnScalerStrategy(compute_config=ComputeConfig(1, 1), pas_policy="dp", state_dict_type="full")
    strategy = NnScalerStrategy(compute_config=ComputeConfig(1, 1), pas_policy="dp")
    plain = Regressor()
    plain.dummy_forward_args = None
    with pytest.raises(ConfigError, match="Regressor needs `dummy_forward_args`.*dummy_forward_args_fn"):
        strategy._dummy_forward_args(None, plain)


def test_world_size_must_be_runtime_ngpus():
    import lightning.pytorch as pl

    from nnscaler import ComputeConfig

    saved = dict(os.environ)  # Lightning's launcher sets MASTER_ADDR, LOCAL_RANK, ... here
    try:
        strategy = NnScalerStrategy(compute_config=ComputeConfig(1, 2), pas_policy="dp")
        with pytest.raises(ConfigError, match="runs 1 processes .* compute_config.runtime_ngpus is 2"):
            trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, max_steps=1)
            trainer.fit(Regressor(), loader())
        assert not torch.distributed.is_initialized()
    finally:
        os.environ.clear()
        os.environ.update(saved)
