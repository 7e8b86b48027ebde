"""What a Trainer run prints: milestones on rank 0 only (generated code, plan, validation loss,
checkpoint saved, resume point), no torch specialisation warnings, one weights-loading bar per job."""

from __future__ import annotations

import logging
import re

import torch

from tests.cli.common import gpt_args
from tests.cli.conventions import train_runs
from tests.dist_util import spawn


def test_milestones_are_printed_on_rank_zero(tmp_path):
    val = {"dataset.val_args.size": 8, "dataset.val_args.seed": 1, "val_every_n_train_steps": 2}
    first = gpt_args(tmp_path, "tp", 2, 2, max_train_steps=2, **val, **{"checkpoint.every_n_train_steps": 2})
    again = gpt_args(tmp_path, "tp", 2, 2, max_train_steps=4, **val, **{"checkpoint.resume_from": "last"})
    (run1, run2), (rank1_run1, rank1_run2) = spawn(train_runs, 2, tmp_path, [first, again])
    out1, out2 = run1[1], run2[1]
    print(out1, out2, sep="\n")
    gen = tmp_path / "gen" / "_parallel_modules" / "examples" / "nanogpt" / "model" / "GPT" / "trainer"
    assert f"nnscaler-train: generated code: {gen}\n" in out1  # under the Trainer's own instance name
    assert (gen / "gencode1.py").is_file()
    assert re.search(
        r"nnscaler-train: plan: tp over 2 rank\(s\) x 1 data-parallel replica\(s\), no pipeline, ZeRO off; "
        r"rank 0 holds [\d,]+ of [\d,]+ parameter values\n",
        out1,
    )
    assert re.search(r"nnscaler-train: validation loss \d+\.\d{4} at step 2\n", out1)
    ckpt = tmp_path / "ckpt" / "0000-0002"
    assert f"nnscaler-train: checkpoint saved: {ckpt} (step 2)\n" in out1
    assert f"nnscaler-train: resumed from {tmp_path / 'ckpt' / 'last'} -> {ckpt} at step 2\n" in out2
    assert re.search(r"validation loss \d+\.\d{4} at step 4\n", out2)
    assert "checkpoint saved: " + str(tmp_path / "ckpt" / "0000-0004") in out2
    assert "resumed" not in out1 and len(run2[0]) == 2  # the second run trained steps 3 and 4 only
    for _, out in (rank1_run1, rank1_run2):
        assert "nnscaler-train:" not in out  # rank 1 is quiet


def test_batch_of_one_traces_without_specialisation_warnings(tmp_path):
    """torch.export warns "dimension ... 0/1 specialized; Dim.AUTO was specified" for every input dim
    of size 1 it was asked to keep open; capture asks only for dims it can keep open."""
    from examples.nanogpt.model import GPT, GPTConfig
    from nnscaler.graph.capture import capture

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    torch_log = logging.getLogger("torch._export.non_strict_utils")
    handler = Keep(level=logging.WARNING)
    torch_log.addHandler(handler)
    try:
        model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16, dropout=0.0))
        capture(
            model,
            {"idx": torch.zeros(1, 8, dtype=torch.long), "targets": torch.zeros(1, 8, dtype=torch.long)},
        )
    finally:
        torch_log.removeHandler(handler)
    assert not [r for r in records if "specialized" in r], records


def test_llama_example_shows_one_weights_loading_bar_per_job(tmp_path, monkeypatch, capfd):
    from transformers import LlamaConfig, LlamaForCausalLM

    from examples.llama3_8B_128K.model import LlamaLM

    cfg = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    capfd.readouterr()
    shown = {}
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        LlamaLM(str(tmp_path))
        shown[rank] = capfd.readouterr().err
    assert "Loading weights" not in shown["1"]
    assert "Loading weights" in shown["0"]  # the one bar of the job
