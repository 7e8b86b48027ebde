"""Setup refuses what would fail later, naming the fix: a short last micro-batch, a YAML key given
twice; `nnscaler-train` imports the user's module from the working directory; the Trainer's code has
its own instance directory and its errors name its own fields."""

from __future__ import annotations

import sys

import pytest
import torch

from nnscaler.cli import Trainer, TrainerArgs
from nnscaler.cli.last_batch import _violations, check_short_micro_batch, input_contract, short_micro_batch
from nnscaler.cli.train import main
from nnscaler.errors import ConfigError
from tests.cli.common import CONFIGS, gpt_args
from tests.cli.conventions import run_expecting_error, train_runs
from tests.dist_util import spawn

GPT_DIR = ("_parallel_modules", "examples", "nanogpt", "model", "GPT")


def test_short_last_micro_batch_the_plan_cannot_take_is_refused_at_setup(tmp_path):
    # 29 samples in micro-batches of 4 under `data` on 2 ranks: the last micro-batch holds 1 sample,
    # which the plan would have to split in 2 (nnScaler 0.8 crashes there at the end of the epoch)
    argv = gpt_args(tmp_path, "data", 2, 2, **{"dataset.train_args.size": 29})
    errors = spawn(run_expecting_error, 2, tmp_path, argv)
    for msg in errors:
        assert msg.startswith("ConfigError: dataset.train_args: the train set has 29 samples"), msg
        assert "7 micro-batches of 4 and a last one of 1" in msg
        assert "cannot take (it needs idx_size0 % 2 == 0; it needs targets_size0 % 2 == 0)" in msg
        assert "Set dataloader.train_args.drop_last: true" in msg
    assert not (tmp_path / "ckpt").exists()  # refused before the first step


def test_short_micro_batch_a_plan_takes_trains_and_drop_last_skips_it(tmp_path):
    # the same data under `tp` (the batch is not split) runs the short micro-batch; under `data` with
    # drop_last it is skipped: 7 micro-batches an epoch, 4 steps (the last with one), 2 epochs
    size = {"dataset.train_args.size": 29, "checkpoint.no_save": None}
    runs = [
        gpt_args(tmp_path / "tp", "tp", 2, 2, **size),
        gpt_args(tmp_path / "data", "data", 2, 2, **size, **{"dataloader.train_args.drop_last": "true"}),
    ]
    results = spawn(train_runs, 2, tmp_path, runs)
    for losses, _ in results[0]:
        assert len(losses) == 8 and losses[-1] < losses[0]
    assert [r[0] for r in results[1]] == [r[0] for r in results[0]]
    # tp saw 2 x 29 samples, data 2 x 28: the last steps differ, the first 3 steps of an epoch do not
    torch.testing.assert_close(results[0][0][0][:3], results[0][1][0][:3], rtol=1e-5, atol=1e-5)


def test_short_validation_micro_batch_is_found():
    args = TrainerArgs.from_cli(gpt_args(CONFIGS, "dp", 1, 2, **{"dataset.val_args.size": 10}))
    short = short_micro_batch(args, args.create_dataset("val"), "val", 2)
    assert short is not None and short.indices and len(short.indices) == 1
    assert (
        "5 per data-parallel replica (2 replica(s)), which is 1 micro-batches of 4 and a last one of 1"
        in (short.describe())
    )
    assert "dataloader.val_args.drop_last: true" in short.fix()
    args = TrainerArgs.from_cli(gpt_args(CONFIGS, "dp", 1, 2, **{"dataset.val_args.size": 16}))
    assert short_micro_batch(args, args.create_dataset("val"), "val", 2) is None  # 8 per replica: divides


def test_a_short_micro_batch_without_generated_code_to_check_is_warned_about_once(caplog):
    args = TrainerArgs.from_cli(gpt_args(CONFIGS, "dp", 1, 2, **{"dataset.train_args.size": 29}))
    ds = args.create_dataset("train")
    with caplog.at_level("WARNING", logger="nnscaler.cli.last_batch"):
        check_short_micro_batch(args, ds, "train", 2, torch.nn.Linear(1, 1), None, rank=1)
        assert not caplog.records  # other ranks are quiet
        check_short_micro_batch(args, ds, "train", 2, torch.nn.Linear(1, 1), None, rank=0)
    (record,) = caplog.records
    assert (
        "a last one of 3: it runs, and its mean loss weighs as much as a full micro-batch's" in record.message
    )


def test_input_contract_is_read_from_generated_code():
    source = """
class GenModel:
    def forward(self, data):
        data_idx_size0, data_idx_size1 = self.input_sizes("data_idx", data_idx, (None, 16))
        self.check_shape(data_idx_size0 % 2 == 0, 'data_idx_size0 % 2 == 0', 'why', {})
        self.check_shape(data_idx_size1 <= 16, 'data_idx_size1 <= 16', 'why', {})
        self.check_shape(view_3_size0 > 1, 'view_3_size0 > 1', 'why', {})
"""
    assert input_contract(source) == (
        {"data_idx": (None, 16)},
        ["data_idx_size0 % 2 == 0", "data_idx_size1 <= 16", "view_3_size0 > 1"],
    )
    short = {"data": {"idx": torch.zeros(3, 16)}}
    assert _violations(source, short) == ["it needs data_idx_size0 % 2 == 0"]
    assert _violations(source, {"data": {"idx": torch.zeros(4, 16)}}) == []
    assert _violations(source, {"data": {"idx": torch.zeros(4, 8)}}) == [
        "data_idx has shape [4, 8] but dim 1 must be 16"
    ]


def test_yaml_key_given_twice_is_refused_naming_key_and_lines(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    text = (CONFIGS / "gpt.yaml").read_text()
    cfg.write_text(text.replace("  args:\n    lr: 0.01\n", "  args:\n    lr: 0.01\n    lr: 0.1\n"))
    line = text.splitlines().index("    lr: 0.01") + 1
    with pytest.raises(ConfigError) as err:
        TrainerArgs.from_yaml(str(cfg))
    assert f"key 'lr' is given twice in one mapping, on line {line} and on line {line + 1}" in str(err.value)
    cfg.write_text(text + "seed: 1\n")  # a top-level key
    seed, last = text.splitlines().index("seed: 0") + 1, len(text.splitlines()) + 1
    with pytest.raises(ConfigError, match=rf"key 'seed' is given twice.*line {seed} and on line {last}\b"):
        TrainerArgs.from_yaml(str(cfg))
    # the same key in two mappings, and a merge key overridden, are fine
    cfg.write_text(text + "vars_base: &b\n  x: 1\nextra_vars:\n  <<: *b\n  x: 2\n")
    from nnscaler.cli.yaml_loader import read_yaml

    assert read_yaml(str(cfg))["extra_vars"] == {"x": 2}


def test_nnscaler_train_imports_the_users_module_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "e1_user_model.py").write_text(
        "from examples.nanogpt.model import GPT\n\n\nclass Net(GPT):\n    pass\n"
    )
    monkeypatch.chdir(tmp_path)
    root = str(CONFIGS.parents[2])
    monkeypatch.setattr(sys, "path", [root] + [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "e1_user_model", raising=False)
    argv = gpt_args(tmp_path, "tp", 2, 2, run_mode="compile", **{"model.type": "e1_user_model.Net"})
    assert main(argv) == 0
    assert (
        tmp_path / "gen" / "_parallel_modules" / "e1_user_model" / "Net" / "trainer" / "gencode1.py"
    ).is_file()
    sys.modules.pop("e1_user_model", None)


def test_trainer_code_has_its_own_instance_and_errors_name_trainer_fields(tmp_path):
    import torch

    import nnscaler
    from examples.nanogpt.model import GPT, GPTConfig

    argv = gpt_args(tmp_path, "tp", 2, 2, run_mode="compile")
    Trainer(argv).run()
    trainer_dir = tmp_path.joinpath("gen", *GPT_DIR, "trainer")
    assert (trainer_dir / "gencode1.py").is_file()
    before = (trainer_dir / "gencode0.py").read_text()
    # a script compiling the same class (no instance name) writes beside it, not over it
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32, dropout=0.0))
    dummy = {"idx": torch.zeros(4, 16, dtype=torch.long), "targets": torch.zeros(4, 16, dtype=torch.long)}
    nnscaler.parallelize(
        model, dummy, "tp", nnscaler.ComputeConfig(2, 2), gen_savedir=tmp_path / "gen", load_module=False
    )
    assert (tmp_path.joinpath("gen", *GPT_DIR, "_") / "gencode0.py").is_file()
    assert (trainer_dir / "gencode0.py").read_text() == before
    # another model under gen_reuse 'match': the error names the Trainer's field
    changed = gpt_args(
        tmp_path, "tp", 2, 2, run_mode="compile", gen_reuse="match", **{"model.args.config.n_layer": 3}
    )
    with pytest.raises(ConfigError) as err:
        Trainer(changed).run()
    msg = str(err.value)
    assert "gen_reuse='match' but" in msg and "gen_reuse='moo'" in msg
    assert "reuse='" not in msg.replace("gen_reuse='", "")
