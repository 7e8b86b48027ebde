"""examples/nanogpt end to end, offline: prepare.py, train.py and the Trainer YAML under torchrun
(4 gloo processes, plan 2), shortened by flags and with a tiny model."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from examples.nanogpt.prepare import decode, ensure_data, load_meta, prepare, stdlib_docstrings

ROOT = Path(__file__).resolve().parents[2]
TINY = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """A small offline corpus shared by the training tests."""
    path = tmp_path_factory.mktemp("nanogpt") / "chars"
    ensure_data(path, offline=True, max_chars=60_000)
    return path


def _torchrun(args: list[str], cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", *args]
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def _first_last(out: str) -> tuple[float, float]:
    m = re.search(r"train loss: first ([\d.]+)\s+last ([\d.]+)", out)
    assert m, out
    return float(m.group(1)), float(m.group(2))


def _sample(out: str, meta: dict) -> str:
    m = re.search(r"sample \((\d+) characters[^\n]*\n(.*)\n---", out, re.S)
    assert m, out
    text = m.group(2)
    assert len(text) == int(m.group(1)) + 1  # the one-character prompt, then the generated ones
    assert set(text) <= set(meta["itos"])
    return text


def test_prepare_offline_writes_a_char_vocabulary_that_round_trips(tmp_path, capsys):
    out = tmp_path / "data"
    info = prepare(out, offline=True, max_chars=20_000)
    said = capsys.readouterr().out
    assert "offline corpus" in said and not info.reused
    meta = load_meta(out)
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    val = np.fromfile(out / "val.bin", dtype=np.uint16)
    assert (len(train), len(val)) == (18_000, 2_000) == (meta["train_tokens"], meta["val_tokens"])
    assert meta["source"] == "python-stdlib-docstrings" and meta["vocab_size"] == len(meta["itos"])
    assert int(max(train.max(), val.max())) < meta["vocab_size"]
    text = stdlib_docstrings(20_000)
    assert decode(train.tolist() + val.tolist(), meta["itos"]) == text  # ids decode to the corpus
    assert meta["itos"] == sorted(set(text))
    before = (out / "train.bin").stat().st_mtime_ns
    again = prepare(out, offline=True, max_chars=20_000)  # idempotent: the files are reused
    assert again.reused and (out / "train.bin").stat().st_mtime_ns == before
    assert "reusing" in capsys.readouterr().out


def test_train_py_learns_and_samples(data_dir, tmp_path):
    flags = [f"--{k}={v}" for k, v in TINY.items()]
    script = str(ROOT / "examples/nanogpt/train.py")
    out = _torchrun(
        [script, "--plan_ngpus", "2", "--runtime_ngpus", "4", "--steps", "30", "--lr", "1e-2", "--offline"]
        + ["--data_dir", str(data_dir), "--sample_tokens", "40", "--eval_iters", "2", *flags],
        tmp_path,
    )
    first, last = _first_last(out)
    assert last < first - 0.8, out
    before, after = map(float, re.search(r"val loss: before ([\d.]+)\s+after ([\d.]+)", out).groups())
    assert after < before - 0.5, out  # measured with the merged weights: the merge kept the training
    _sample(out, load_meta(data_dir))
    gen = tmp_path / ".nnscaler/_parallel_modules/examples/nanogpt/model/GPT/_"
    assert sorted(p.name for p in gen.glob("gencode*.py")) == [f"gencode{r}.py" for r in range(4)]
    assert f"generated code: {gen}/gencode{{0..3}}.py" in out


def test_trainer_yaml_learns_and_samples(data_dir, tmp_path):
    overrides = {f"model.args.config.{k}": v for k, v in TINY.items() if k != "block_size"}
    overrides |= {"vars.block": TINY["block_size"], "vars.data_dir": data_dir, "vars.offline": True}
    overrides |= {"max_train_steps": 12, "optimizer.args.lr": 1e-2, "max_val_steps": 2}
    argv = ["-m", "nnscaler.cli.train", "-f", str(ROOT / "examples/nanogpt/train_cli.yaml")]
    argv += [x for k, v in overrides.items() for x in (f"--{k}", str(v))]
    out = _torchrun(argv, tmp_path)
    first, last = _first_last(out)
    assert last < first - 0.8, out
    assert "step 12/12" in out
    val = float(re.search(r"val loss: ([\d.]+)", out).group(1))
    assert val < first - 0.5, out
    _sample(out, load_meta(data_dir))
    assert (tmp_path / "checkpoints/nanogpt_char/last").exists()
    gen = tmp_path / ".nnscaler/_parallel_modules/examples/nanogpt/model/GPT/trainer"
    assert sorted(p.name for p in gen.glob("gencode*.py")) == [f"gencode{r}.py" for r in range(4)]


def test_prepare_downloads_shakespeare_and_falls_back_saying_so(tmp_path, monkeypatch, capsys):
    import io
    import urllib.request

    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n\n" * 40

    def fake_urlopen(url, timeout):
        assert "tinyshakespeare" in url and timeout <= 10
        return io.BytesIO(text.encode())

    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)
    info = prepare(tmp_path / "shakespeare", offline=False)
    meta = load_meta(tmp_path / "shakespeare")
    assert (info.source, meta["vocab_size"], meta["chars"]) == ("tinyshakespeare", len(set(text)), len(text))
    assert "offline corpus" not in capsys.readouterr().out

    def no_network(url, timeout):
        raise OSError("Name or service not known")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    info = prepare(tmp_path / "fallback", offline=False, max_chars=5_000)
    said = capsys.readouterr().out
    assert "could not download tinyshakespeare" in said and "using the offline corpus" in said
    assert info.source == "python-stdlib-docstrings" and info.train_tokens + info.val_tokens == 5_000
