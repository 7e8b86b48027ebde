"""TrainerArgs: YAML + overrides, $(vars) and __type factories, batch-size arithmetic, clear errors."""

from __future__ import annotations

import pytest

import nnscaler
from nnscaler.cli.trainer_args import (
    ComputeConfig,
    LogConfig,
    OptionalComputeConfig,
    TrainerArgs,
    TypeLoadError,
    load_type,
)
from nnscaler.errors import ConfigError
from tests.cli.common import CONFIGS

GPT_YAML = str(CONFIGS / "gpt.yaml")


def make_instance_name(stem: str) -> str:
    return f"instance_{stem}"


def minimal(**extra):
    d = {
        "compute_config": {"plan_ngpus": 1, "runtime_ngpus": 4},
        "model": {"type": "examples.nanogpt.model.GPT"},
        "optimizer": {"type": "torch.optim.SGD"},
        "dataset": {"type": "tests.cli.common.CountingTokens"},
        "max_train_steps": 1,
        "seed": 0,
    }
    d.update(extra)
    return d


def test_load_type():
    assert load_type(int) is int
    assert load_type("int") is int
    assert load_type("int.to_bytes") is int.to_bytes
    assert load_type("nnscaler.cli.trainer_args.TrainerArgs") is TrainerArgs
    assert load_type("nnscaler.cli.trainer_args.TrainerArgs.from_cli") == TrainerArgs.from_cli
    for bad in ("not_exist_name", "not_exist_namespace.not_exist_name", "nnscaler.not_exist_name"):
        with pytest.raises(RuntimeError):
            load_type(bad)
    with pytest.raises(
        TypeLoadError, match="'nnscaler.cli.trainer_args.TrainerArgs' has no attribute 'nope'"
    ):
        load_type("nnscaler.cli.trainer_args.TrainerArgs.nope")


def test_optional_compute_config_overlays_and_turns_off_end2end():
    cc = ComputeConfig(1, 2, constant_folding=True, use_end2end=True, use_zero=True)
    got = OptionalComputeConfig(constant_folding=False, use_zero=False).resolve(cc)
    assert got == ComputeConfig(1, 2, constant_folding=False, use_end2end=False)
    with pytest.raises(ValueError, match="zero_ngroups"):
        OptionalComputeConfig(zero_ngroups=-1).resolve(cc)


def test_yaml_with_overrides_and_vars():
    args = TrainerArgs.from_cli(
        ["-f", GPT_YAML, "--vars.vocab", "48", "--vars.hello", "$(compute_config.plan_ngpus)", "--seed", "3"]
    )
    assert args.vars["vocab"] == 48 and args.dataset.train_args["vocab"] == 48
    assert args.vars["hello"] == args.compute_config.plan_ngpus == 2
    assert args.seed == 3 and args.compute_config.use_end2end  # filled in when left out
    model = args.create_model()  # the GPTConfig came from a __type factory
    assert isinstance(model, nnscaler.cli.trainer_args.torch.nn.Module) and model.config.vocab_size == 48
    assert args.model.args["config"]["vocab_size"] == 48  # the config dict itself is left as data
    assert TrainerArgs.from_dict(args.to_dict()).to_dict() == args.to_dict()


def test_factory_for_instance_name_and_deleted_key():
    args = TrainerArgs.from_cli(
        ["-f", GPT_YAML, "--instance_name.__type", "tests.cli.test_trainer_args.make_instance_name"]
        + ["--instance_name.stem", "p$(compute_config.plan_ngpus)", "--compute_config.plan_ngpus", "1"]
        + ["--lr_scheduler!"]
    )
    assert args.instance_name == "instance_p1"
    assert args.lr_scheduler is None


def test_from_yaml_equals_from_cli():
    assert TrainerArgs.from_yaml(GPT_YAML).to_dict() == TrainerArgs.from_cli(["-f", GPT_YAML]).to_dict()


def test_value_type_and_self_references():
    args = TrainerArgs.from_dict(minimal(vars={"k": {"__value_type": "int", "value": "7"}}))
    assert args.create_kwarg(
        {"a": "$!(vars.k)", "me": "$!(self)", "f": {"__value_type": "function", "value": "len"}}
    ) == {
        "a": 7,
        "me": args,
        "f": len,
    }
    with pytest.raises(ConfigError, match=r"\$!\(self\) or \$!\(vars.x\)"):
        args.create_kwarg("$!(model.type)")


@pytest.mark.parametrize(
    "micro, gbs, accum, want",
    [(2, None, None, (8, 1)), (2, 16, None, (16, 2)), (2, None, 3, (24, 3)), (1, 8, 2, (8, 2))],
)
def test_batch_sizes_any_two_give_the_third(micro, gbs, accum, want):
    args = TrainerArgs.from_dict(
        minimal(micro_batch_size=micro, global_batch_size=gbs, grad_accumulation_steps=accum)
    )
    assert (args.global_batch_size, args.grad_accumulation_steps) == want
    assert args.update_freq == want[1] and args.scaling_factor == 4


def test_inconsistent_batch_sizes():
    with pytest.raises(
        ConfigError,
        match=r"global_batch_size \(12\) != micro_batch_size \(2\) x data-parallel replicas \(4\)",
    ):
        TrainerArgs.from_dict(minimal(micro_batch_size=2, global_batch_size=12, grad_accumulation_steps=2))
    with pytest.raises(ConfigError, match=r"global_batch_size \(12\) must be a multiple"):
        TrainerArgs.from_dict(minimal(micro_batch_size=2, global_batch_size=12))


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"max_train_step": 3},
            r"unknown field max_train_step in TrainerArgs; did you mean 'max_train_steps'",
        ),
        (
            {"optimizer": {"type": "torch.optim.SGD", "clip_gnrm": 1}},
            r"optimizer\.clip_gnrm.*did you mean 'clip_gnorm'",
        ),
        ({"micro_batch_size": "two"}, r"micro_batch_size: expected int, got 'two'"),
        ({"compute_config": {"plan_ngpus": "x"}}, r"compute_config\.plan_ngpus: expected int"),
        ({"dataset": {}}, r"dataset\.type is required"),
        ({"max_train_steps": None}, r"max_epochs or max_train_steps is required"),
        ({"compute_config": None}, r"compute_config is required"),
        (
            {"compute_config": {"plan_ngpus": 1, "runtime_ngpus": 4, "use_end2end": False}},
            "use_end2end must be True",
        ),
        ({"run_mode": "train"}, "run_mode must be 'run' or 'compile'"),
        ({"checkpoint": {"save_type": "zipped"}}, r"checkpoint\.save_type must be one of"),
        (
            {"checkpoint": {"resume_from": "/no/such/ckpt"}},
            r"checkpoint\.resume_from: /no/such/ckpt does not exist",
        ),
        ({"lr_scheduler": {"type": "x.Y", "interval": "batch"}}, r"lr_scheduler\.interval must be one of"),
        (
            {"dataloader": {"train_args": {"batch_size": 4}}},
            r"dataloader\.train_args\.batch_size is set by the trainer",
        ),
        ({"precision": "fp8"}, r"precision\.param must be one of"),
        ({"gen_reuse": "sometimes"}, "gen_reuse must be 'auto' or one of"),
    ],
)
def test_bad_configs_name_the_field(change, message):
    d = minimal()
    d.update(change)
    if change.get("max_train_steps", 1) is None:
        del d["max_train_steps"]
    if "compute_config" in change and change["compute_config"] is None:
        del d["compute_config"]
    with pytest.raises(ConfigError, match=message):
        TrainerArgs.from_dict(d)


def test_cli_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        TrainerArgs.from_cli(["-f", str(tmp_path / "missing.yaml")])
    with pytest.raises(ConfigError, match="-f cfg.yaml must come first"):
        TrainerArgs.from_cli(["--seed", "1", "-f", GPT_YAML])
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        TrainerArgs.from_cli(["-f", str(bad)])


def test_defaults_and_derived_values():
    args = TrainerArgs.from_dict(
        minimal(run_mode="compile", precision={"param": "bf16"}, log=[{"type": "TensorBoardLogger"}])
    )
    assert args.gen_reuse == "moo" and args.compile_mode
    assert args.checkpoint.every_n_epochs == 1
    assert args.param_dtype is nnscaler.cli.trainer_args.torch.bfloat16 and args.input_dtype is None
    assert args.log == [LogConfig(type="nnscaler.cli.loggers.TensorBoardLogger")]
    assert args.resolved_pas_policy == "autodist"
    assert TrainerArgs.from_dict(minimal()).gen_reuse == "match"


def test_hook_forms():
    from nnscaler.cli.configs import ArgsTrainHook, HookConfig, HookMapConfig
    from nnscaler.cli.train_hook import TrainHook

    args = TrainerArgs.from_dict(minimal(hook={"on_train_start": "builtins.print"}))
    assert isinstance(args.hook, HookMapConfig)
    hook = args.create_hook()
    assert isinstance(hook, ArgsTrainHook) and hook.on_train_start is print
    args = TrainerArgs.from_dict(minimal(hook={"type": "nnscaler.cli.train_hook.TrainHook"}))
    assert isinstance(args.hook, HookConfig) and type(args.create_hook()) is TrainHook
    with pytest.raises(ConfigError, match="did you mean 'on_train_start'"):
        TrainerArgs.from_dict(minimal(hook={"on_train_strt": "builtins.print"}))
