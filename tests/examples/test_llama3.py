"""examples/llama3_8B_128K end to end, offline: a mini model and a byte-level dataset, the documented
CPU run (torchrun, 4 gloo processes, plan 2) shortened by flags, and `--run_mode compile` of the mini
model, and of Llama-3-8B at 128K tokens for 8 ranks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from examples.llama3_8B_128K import bookcorpus, create_mini_model, train
from examples.llama3_8B_128K.data import BOS, BYTE_VOCAB, EOS, TokenDataset, byte_decode

ROOT = Path(__file__).resolve().parents[2]
SEQ = 64
GEN = "_parallel_modules/examples/llama3_8B_128K/model/LlamaLM"


@pytest.fixture(scope="module")
def mini(tmp_path_factory) -> tuple[Path, Path]:
    """The mini model's directory and an offline dataset of SEQ-token rows."""
    root = tmp_path_factory.mktemp("llama3")
    create_mini_model.main(["--output_dir", str(root / "mini")])
    bookcorpus.main(
        ["--offline", "--seq_len", str(SEQ), "--max_rows", "256", "--save_path", str(root / "data")]
    )
    return root / "mini", root / "data"


def test_mini_model_and_offline_dataset(mini, capsys):
    model_dir, data_dir = mini
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"]) == (2, 128)
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # grouped-query attention
    assert config["vocab_size"] >= BYTE_VOCAB and (model_dir / "model.safetensors").stat().st_size > 1e6
    meta = json.loads((data_dir / "meta.json").read_text())
    assert meta == {
        "source": "python-stdlib-sources",
        "tokenizer": "bytes",
        "vocab_size": BYTE_VOCAB,
        "seq_len": SEQ,
        "rows": 256,
    }
    tokens = np.load(data_dir / "tokens.npy")
    assert tokens.shape == (256, SEQ) and tokens.min() >= 0 and tokens.max() < BYTE_VOCAB
    flat = tokens.ravel().tolist()
    assert flat[0] == BOS and EOS in flat  # documents packed as BOS text EOS
    first_doc = byte_decode(flat[1 : flat.index(EOS)])
    assert first_doc == bookcorpus.stdlib_files()[0].read_text(encoding="utf-8")
    sample = TokenDataset(str(data_dir))[3]
    assert sample["labels"][:-1].tolist() == sample["input_ids"][1:].tolist()
    assert sample["labels"][-1] == -100


def test_llama_lm_loads_local_weights_and_builds_meta(mini):
    import torch
    from safetensors.torch import load_file

    from examples.llama3_8B_128K.model import LlamaLM

    model_dir, data_dir = mini
    saved = load_file(model_dir / "model.safetensors")
    model = LlamaLM(str(model_dir))
    assert all(torch.equal(model.model.state_dict()[k], v) for k, v in saved.items())
    batch = {k: v[None] for k, v in TokenDataset(str(data_dir))[0].items()}
    logits = model.model(input_ids=batch["input_ids"]).logits[0, :-1]
    expected = torch.nn.functional.cross_entropy(logits, batch["input_ids"][0, 1:])
    torch.testing.assert_close(model(**batch), expected)  # the mean next-token loss
    meta = LlamaLM(str(model_dir), meta=True)
    assert all(p.is_meta for p in meta.parameters())


def test_bookcorpus_falls_back_to_the_byte_tokenizer_saying_so(tmp_path, monkeypatch, capsys):
    def no_hub(data_name, tokenizer):
        raise OSError("Name or service not known")

    monkeypatch.setattr(bookcorpus, "hf_docs", no_hub)
    text = tmp_path / "book.txt"
    text.write_text("Call me Ishmael. \u00e9t\u00e9\n" * 40, encoding="utf-8")
    meta = bookcorpus.main(
        ["--data_name", "bookcorpus", "--tokenizer", "meta-llama/Meta-Llama-3-8B", "--seq_len", "100"]
        + ["--text_file", str(text), "--save_path", str(tmp_path / "out")]
    )
    said = capsys.readouterr().out
    assert "could not read bookcorpus with meta-llama/Meta-Llama-3-8B (OSError" in said
    assert f"offline: tokenizing {text} with the byte-level tokenizer" in said
    ids = [BOS, *text.read_bytes(), EOS]
    rows = np.load(tmp_path / "out/tokens.npy")
    assert (meta.rows, meta.source) == (len(ids) // 100, str(text)) and rows.shape == (meta.rows, 100)
    assert rows.ravel().tolist() == ids[: meta.rows * 100]  # packed in order, the remainder dropped


def _torchrun(args: list[str], cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", *args]
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def test_torchrun_cpu_run_learns(mini, tmp_path):
    model_dir, data_dir = mini
    out = _torchrun(
        [str(ROOT / "examples/llama3_8B_128K/train.py"), "--plan_ngpus", "2", "--runtime_ngpus", "4"]
        + ["--model_id", str(model_dir), "--dataset_path", str(data_dir), "--max_train_steps", "20"]
        + ["--lr", "1e-2", "--micro_batch_size", "4", "--log_every", "1", "--name", "mini"],
        tmp_path,
    )
    losses = [float(x) for x in re.findall(r"step \d+/20  loss ([\d.]+)", out)]
    assert len(losses) == 20, out
    first, last = map(float, re.search(r"train loss: first ([\d.]+)\s+last ([\d.]+)", out).groups())
    assert (first, last) == (losses[0], losses[-1])
    assert first > 5.0  # about ln(264) from the random init
    assert np.mean(losses[-5:]) < first - 2.0, losses
    gen = tmp_path / ".nnscaler" / GEN / "mini"
    assert sorted(p.name for p in gen.glob("gencode*.py")) == [f"gencode{r}.py" for r in range(4)]
    assert f"generated code: {gen}/gencode{{0..3}}.py" in out
    assert (tmp_path / "checkpoints/mini/last").exists()


def test_torchrun_pipeline_with_recompute_learns(mini, tmp_path):
    """The README's second CPU command: stages at decoder layers, 4 micro-batches, layers recomputed."""
    model_dir, data_dir = mini
    out = _torchrun(
        [str(ROOT / "examples/llama3_8B_128K/train.py"), "--plan_ngpus", "2", "--runtime_ngpus", "4"]
        + ["--model_id", str(model_dir), "--dataset_path", str(data_dir), "--max_train_steps", "8"]
        + ["--lr", "1e-2", "--pipeline_pivots", "LlamaDecoderLayer", "--grad_accumulation_steps", "4"]
        + ["--recompute_modules", "LlamaDecoderLayer", "--log_every", "1", "--name", "mini_pp"],
        tmp_path,
    )
    plan = json.loads((tmp_path / ".nnscaler" / GEN / "mini_pp" / "plan.json").read_text())
    assert plan["pipeline"]["pp_size"] == 2 and plan["pipeline"]["nmicros"] == 4
    assert plan["recompute"] == ["model.model.layers.0", "model.model.layers.1"]
    losses = [float(x) for x in re.findall(r"step \d+/8  loss ([\d.]+)", out)]
    assert len(losses) == 8 and losses[0] > 5.0, out
    assert np.mean(losses[-3:]) < losses[0] - 1.0, losses


def _compile(argv: list[str], cwd: Path, monkeypatch) -> None:
    monkeypatch.chdir(cwd)
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    train.main(["--run_mode", "compile", *argv])


def test_compile_mini_plan2(mini, tmp_path, monkeypatch, capsys):
    model_dir, data_dir = mini
    _compile(
        [
            "--plan_ngpus",
            "2",
            "--model_id",
            str(model_dir),
            "--dataset_path",
            str(data_dir),
            "--policy",
            "tp",
        ],
        tmp_path,
        monkeypatch,
    )
    out = capsys.readouterr().out
    gen = tmp_path / ".nnscaler" / GEN / f"mini_{SEQ}"  # the default --name: {model dir}_{seq_len}
    assert sorted(p.name for p in gen.glob("gencode*.py")) == ["gencode0.py", "gencode1.py"]
    assert f"generated code: {gen}/gencode{{0..1}}.py" in out
    code = (gen / "gencode1.py").read_text()
    # one sdpa per layer, no mask tensor: written once, in the layer function both layers call
    assert code.count("is_causal=True") == 1 and code.count("self._layer_LlamaDecoderLayer(") == 2
    assert "vocab_parallel_cross_entropy" in code  # the loss over tensor-parallel logits


def test_compile_llama3_8b_at_128k_for_8_ranks(tmp_path, monkeypatch, capsys):
    """The README's full-size compile (with --policy tp, the faster one): all 32 layers of Llama-3-8B on
    the meta device, 131072 tokens, 8 ranks, traced without a seq x seq mask."""
    _compile(
        ["--plan_ngpus", "8", "--runtime_ngpus", "8", "--model_id", "meta-llama/Meta-Llama-3-8B"]
        + ["--offline", "--seq_len", "131072", "--policy", "tp"],
        tmp_path,
        monkeypatch,
    )
    out = capsys.readouterr().out
    assert "using the Llama-3-8B values built into" in out
    assert '"num_hidden_layers": 32, "hidden_size": 4096' in out and '"vocab_size": 128256' in out
    gen = tmp_path / ".nnscaler" / GEN / "Meta-Llama-3-8B_131072"
    assert sorted(p.name for p in gen.glob("gencode*.py")) == [f"gencode{r}.py" for r in range(8)]
    assert f"generated code: {gen}/gencode{{0..7}}.py" in out
    code = (gen / "gencode3.py").read_text()
    assert "local [1, 131072, 512] of [1, 131072, 4096]" in code  # q_proj column-parallel over 8
    assert code.count("is_causal=True") == 1 and "131072, 131072" not in code  # in the layer function
    assert code.count("self._layer_LlamaDecoderLayer(") == 32  # one call per layer
    assert "vocab_parallel_cross_entropy" in code


def test_torchrun_context_parallel_with_chunk_loss_learns(mini, tmp_path):
    """The README's context-parallel CPU command: the sequence over 2 ranks (zigzag ring) x tp 2, loss chunked."""
    model_dir, data_dir = mini
    out = _torchrun(
        [str(ROOT / "examples/llama3_8B_128K/train.py"), "--plan_ngpus", "4", "--runtime_ngpus", "4"]
        + ["--model_id", str(model_dir), "--dataset_path", str(data_dir), "--max_train_steps", "10"]
        + ["--lr", "1e-2", "--policy", "tp", "--context_parallel", "zigzag", "--cp_size", "2"]
        + ["--enable_chunk_loss", "--log_every", "1", "--name", "mini_cp"],
        tmp_path,
    )
    plan = json.loads((tmp_path / ".nnscaler" / GEN / "mini_cp" / "plan.json").read_text())
    assert plan["context_parallel"]["size"] == 2 and plan["mesh"] == [2, 2]
    code = (tmp_path / ".nnscaler" / GEN / "mini_cp" / "gencode0.py").read_text()
    assert "context_parallel.context_parallel_attention(" in code and "kind='zigzag'" in code
    assert "chunk_linear_cross_entropy" in code
    losses = [float(x) for x in re.findall(r"step \d+/10  loss ([\d.]+)", out)]
    assert len(losses) == 10 and losses[0] > 5.0, out
    assert np.mean(losses[-3:]) < losses[0] - 1.0, losses


def test_compile_llama3_8b_at_128k_with_context_parallel(tmp_path, monkeypatch, capsys):
    """8B at 128K on 8 ranks: the sequence over 4 (zigzag), heads over 2, the loss chunked."""
    _compile(
        ["--plan_ngpus", "8", "--runtime_ngpus", "8", "--model_id", "meta-llama/Meta-Llama-3-8B"]
        + ["--offline", "--seq_len", "131072", "--policy", "tp", "--context_parallel", "zigzag"]
        + ["--cp_size", "4", "--enable_chunk_loss", "--name", "cp4"],
        tmp_path,
        monkeypatch,
    )
    code = (tmp_path / ".nnscaler" / GEN / "cp4" / "gencode5.py").read_text()
    assert "local [1, 32768, 2048] of [1, 131072, 4096]" in code  # q_proj: sequence / 4, heads / 2
    assert code.count("context_parallel.context_parallel_attention(") == 1  # in the layer function
    assert "chunk_linear_cross_entropy" in code and "131072, 128256" not in code  # logits never whole
