"""The Trainer and its policy agree on micro-batches (issue 43): a built-in policy that plans pipelines
(autodist, pp, hybrid) takes grad_accumulation_steps as pipeline_nmicros, so the Trainer never refuses
the plan it asked for; a pas_config value that disagrees is refused naming both fields."""

from __future__ import annotations

import pytest

from nnscaler.cli import Trainer, TrainerArgs
from nnscaler.errors import ConfigError
from tests.cli.common import gpt_args
from tests.dist_util import spawn

COMMON = {"checkpoint.no_save": None, "max_train_steps": 4, "log_progress_every_n_train_steps": 0}


def _train(rank: int, world: int, argv: list[str]) -> tuple[bool, int | None, list[float]]:
    trainer = Trainer(argv)
    trainer.run()
    model = trainer.model
    nmicros = model.nmicros_per_scheduler_step if model.use_scheduler else None
    return model.use_scheduler, nmicros, trainer.losses


def test_autodist_pipeline_runs_the_trainers_micro_batches(tmp_path):
    # two stages asked for, the micro-batch count left to the Trainer: 3 is none of the counts the
    # planner would pick by itself (stages x 1, 2, 4), so only the Trainer's value can make them agree
    argv = gpt_args(
        tmp_path,
        "autodist",
        2,
        2,
        grad_accumulation_steps=3,
        **{"compute_config.pas_config.pipeline_nstages": 2},
        **COMMON,
    )
    results = spawn(_train, 2, tmp_path, argv)
    for pipelined, nmicros, losses in results:
        assert pipelined and nmicros == 3
        assert len(losses) == 4 and losses[-1] < losses[0]


def test_autodist_free_choice_trains_with_one_micro_batch(tmp_path):
    # nanoGPT's train_cli.yaml: autodist on 2 devices, no accumulation; the planner chooses freely
    argv = gpt_args(tmp_path, "autodist", 2, 2, grad_accumulation_steps=1, **COMMON)
    for _pipelined, nmicros, losses in spawn(_train, 2, tmp_path, argv):
        assert nmicros in (None, 1)  # a pipeline, if chosen, runs the step's one micro-batch
        assert len(losses) == 4 and losses[-1] < losses[0]


@pytest.mark.parametrize("key", ["pipeline_nmicros", "update_freq"])
def test_conflicting_pas_config_is_refused_naming_both_fields(tmp_path, key):
    argv = gpt_args(
        tmp_path, "autodist", 2, 2, grad_accumulation_steps=2, **{f"compute_config.pas_config.{key}": 8}
    )
    with pytest.raises(ConfigError) as err:
        TrainerArgs.from_cli(argv)
    assert f"compute_config.pas_config.{key} (8)" in str(err.value)
    assert "grad_accumulation_steps (2)" in str(err.value)


def test_pipeline_policies_take_the_accumulation_steps(tmp_path):
    for policy in ("pp", "hybrid", "autodist"):
        args = TrainerArgs.from_cli(gpt_args(tmp_path, policy, 2, 2, grad_accumulation_steps=4))
        assert args.compute_config.pas_config["pipeline_nmicros"] == 4
    same = gpt_args(
        tmp_path, "pp", 2, 2, grad_accumulation_steps=4, **{"compute_config.pas_config.pipeline_nmicros": 4}
    )
    assert TrainerArgs.from_cli(same).compute_config.pas_config["pipeline_nmicros"] == 4
    legacy = gpt_args(
        tmp_path, "autodist", 2, 2, grad_accumulation_steps=4, **{"compute_config.pas_config.update_freq": 4}
    )
    assert "pipeline_nmicros" not in TrainerArgs.from_cli(legacy).compute_config.pas_config  # 0.8's key kept
    tp = TrainerArgs.from_cli(gpt_args(tmp_path, "tp", 2, 2, grad_accumulation_steps=4))
    assert "pipeline_nmicros" not in tp.compute_config.pas_config  # tp plans no pipeline
