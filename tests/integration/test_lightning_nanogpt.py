"""examples/nanogpt/train_nnscaler.py: nanoGPT-style configuration, and the GPT trained as a
two-stage pipeline through Lightning + NnScalerStrategy under torchrun (loss falls, the merged
checkpoint loads into a plain GPT)."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from examples.nanogpt.model import GPT, GPTConfig
from examples.nanogpt.prepare import ensure_data, load_meta
from examples.nanogpt.train_nnscaler import configure

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "nanogpt" / "train_nnscaler.py"
TINY = ROOT / "examples" / "nanogpt" / "config" / "tiny.py"


def test_config_files_then_flags_override_the_defaults(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = configure([str(TINY), "--plan_ngpus=2", "--learning_rate=1", "--policy=pp"])
    assert (cfg["n_layer"], cfg["max_steps"]) == (2, 20)  # from the file
    assert (cfg["plan_ngpus"], cfg["policy"], cfg["learning_rate"]) == (2, "pp", 1.0)
    assert cfg["runtime_ngpus"] == 4  # -1 -> $WORLD_SIZE
    with pytest.raises(SystemExit, match="--lr=1: expected --key=value with key one of"):
        configure(["--lr=1"])
    with pytest.raises(SystemExit, match="--max_steps=many: expected a int"):
        configure(["--max_steps=many"])


def test_pipeline_training_learns_and_merges(tmp_path):
    data = tmp_path / "data"
    ensure_data(data, offline=True, max_chars=60_000, verbose=False)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [str(SCRIPT), str(TINY), "--policy=pp", "--plan_ngpus=2", "--offline=True"]
    cmd += [f"--data_dir={data}", f"--out_dir={tmp_path / 'out'}", f"--gen_savedir={tmp_path / 'gen'}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    found = re.search(
        r"metrics after 20 steps: \{'train_loss': ([\d.]+), 'val_loss': ([\d.]+)\}", proc.stdout
    )
    assert found, proc.stdout[-3000:]
    vocab = load_meta(data)["vocab_size"]
    assert float(found.group(1)) < math.log(vocab) - 0.5  # below a uniform guess
    assert sorted(p.name for p in (tmp_path / "out" / "last.ckpt").iterdir()) == ["rank0.ckpt", "rank1.ckpt"]
    state = torch.load(tmp_path / "out" / "merged.ckpt", weights_only=False)["state_dict"]
    plain = GPT(GPTConfig(block_size=32, vocab_size=vocab, n_layer=2, n_head=2, n_embd=32))
    plain.load_state_dict({k.removeprefix("gpt."): v for k, v in state.items()})  # strict
    assert "sample:" in proc.stdout
