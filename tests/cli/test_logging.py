"""Loggers and progress: TensorBoard event files hold the logged scalars; the summary line without a
TTY; compile mode writes code for the asked runtime_ngpus and exits; the plot verb fails clearly
without matplotlib; the hooks are called with nnScaler's names."""

from __future__ import annotations

import importlib.util
import io

import pytest

from nnscaler.cli import Trainer, TrainHook
from nnscaler.cli.plot import read_scalars
from nnscaler.cli.progress import Progress
from nnscaler.cli.train import main
from nnscaler.cli.trainer_args import TrainerArgs
from tests.cli.common import gpt_args


class RecordingHook(TrainHook):
    calls: list[str] = []

    def __init__(self, tag: str = ""):
        RecordingHook.calls = []
        self.tag = tag

    def __getattribute__(self, name):
        if name.startswith(("on_", "after_", "before_")):
            RecordingHook.calls.append(name)
        return super().__getattribute__(name)


def test_tensorboard_scalars_validation_and_hooks(tmp_path):
    tb = tmp_path / "tb"
    argv = gpt_args(
        tmp_path,
        "dp",
        1,
        1,
        **{
            "log.0.type": "TensorBoardLogger",
            "log.0.args.root_dir": str(tb),
            "log.0.args.name": "run1",
            "dataset.val_args.size": 16,
            "dataset.val_args.seed": 1,
            "val_every_n_train_steps": 4,
            "hook.type": "tests.cli.test_logging.RecordingHook",
            "hook.args.tag": "x",
            "checkpoint.no_save": None,
        },
    )
    trainer = Trainer(argv)
    trainer.run()
    scalars = read_scalars(tb / "run1")
    assert [s for s, _ in scalars["train/loss"]] == list(range(1, 9))
    assert [v for _, v in scalars["train/loss"]] == pytest.approx(trainer.losses, rel=1e-6)
    assert [s for s, _ in scalars["val/loss"]] == [4, 8]
    assert scalars["val/loss"][1][1] < scalars["val/loss"][0][1]
    lrs = [v for _, v in scalars["train/lr"]]
    assert lrs[0] == pytest.approx(0.01) and lrs[-1] == pytest.approx(0.0025)  # StepLR per step
    calls = RecordingHook.calls
    for name in (
        "after_setup",
        "on_train_start",
        "on_epoch_start",
        "on_step_start",
        "on_train_step_start",
        "after_aggregate_train_step_outputs",
        "before_gnorm_clip",
        "after_gnorm_clip",
        "before_optimizer_step",
        "after_optimizer_step",
        "before_zero_grad",
        "on_step_end",
        "on_val_start",
        "on_val_end",
        "on_train_end",
        "on_finalize",
    ):
        assert name in calls, name
    assert calls.count("on_step_start") == 8 and calls.index("after_setup") < calls.index("on_train_start")


def test_summary_line_without_a_tty():
    args = TrainerArgs.from_cli(gpt_args(__import__("pathlib").Path("/tmp"), "dp", 1, 1))
    out = io.StringIO()
    progress = Progress(args, total=8, active=True, stream=out)
    for step in range(1, 9):
        progress.update(step, 4.0 - step / 10, 100.0)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("step 4/8  loss 3.6000") and "eta" in lines[0]
    silent = io.StringIO()
    Progress(args, total=8, active=False, stream=silent).update(4, 1.0, 1.0)
    assert silent.getvalue() == ""


def test_progress_bar_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    args = TrainerArgs.from_cli(
        gpt_args(__import__("pathlib").Path("/tmp"), "dp", 1, 1, enable_progress_bar="true")
    )
    out = Terminal()
    progress = Progress(args, total=8, active=True, stream=out)
    for step in range(1, 9):
        progress.update(step, 4.0 - step / 10, 100.0)
    progress.close()
    text = out.getvalue()
    assert "8/8" in text and "loss=3.2000" in text and "samples_s=100.0" in text
    assert "step 4/8" not in text  # the bar replaces the summary lines


def test_compile_mode_writes_code_for_every_rank_and_exits(tmp_path, capsys):
    trainer = Trainer(gpt_args(tmp_path, "tp", 2, 4, run_mode="compile", global_batch_size=16))
    trainer.run()
    files = sorted(p.name for p in (tmp_path / "gen").rglob("gencode*.py"))
    assert files == [f"gencode{r}.py" for r in range(4)]
    assert trainer.optimizer is None and not (tmp_path / "ckpt").exists()
    assert "generated code for 4 ranks" in capsys.readouterr().out


def test_plot_writes_a_png_or_says_how_to_get_matplotlib(tmp_path, capsys):
    Trainer(
        gpt_args(
            tmp_path,
            "dp",
            1,
            1,
            max_train_steps=2,
            **{
                "log.0.type": "TensorBoardLogger",
                "log.0.args.root_dir": str(tmp_path / "tb"),
                "checkpoint.no_save": None,
            },
        )
    ).run()
    status = main(["plot", str(tmp_path / "tb" / "run"), str(tmp_path / "loss.png")])
    if importlib.util.find_spec("matplotlib") is None:
        assert status == 2 and "pip install matplotlib" in capsys.readouterr().err
    else:
        assert status == 0 and (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_wandb_logger_calls(monkeypatch, tmp_path):
    """wandb is optional and not installed here: a stand-in module records what the logger does."""
    import sys
    import types

    calls = []

    class Run:
        def log(self, data, step):
            calls.append(("log", data, step))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    argv = gpt_args(
        tmp_path,
        "dp",
        1,
        1,
        max_train_steps=2,
        **{
            "log.0.type": "WandbLogger",
            "log.0.args.project": "p",
            "log.0.args.mode": "offline",
            "checkpoint.no_save": None,
        },
    )
    Trainer(argv).run()
    assert calls[0][0] == "init" and calls[0][1]["project"] == "p" and calls[0][1]["mode"] == "offline"
    assert calls[0][1]["config"]["pas_policy"] == "dp"
    assert [c[2] for c in calls if c[0] == "log"] == [1, 2] and calls[-1] == ("finish",)
