"""Every field of `TrainerArgs` and of its nested config dataclasses either applies or is refused
(issue 41): a table of invalid values per field (wrong type, out of range, unknown name, contradicting
another field, cannot apply), each raising a ConfigError that names the field by its dotted path. The
fields are walked from the dataclasses themselves: a new field without a row fails
`test_every_field_has_a_row`. ComputeConfig's own fields are H4's table
(tests/settings/test_compute_config_table.py); here `compute_config` is one field."""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from typing import Any, NamedTuple

import pytest

from nnscaler.cli.configs import HookConfig, HookMapConfig
from nnscaler.cli.train_hook import HOOK_NAMES
from nnscaler.cli.trainer_args import TrainerArgs
from nnscaler.config import ComputeConfig
from nnscaler.errors import ConfigError

BASE: dict[str, Any] = {
    "compute_config": {"plan_ngpus": 1, "runtime_ngpus": 2},
    "model": {
        "type": "examples.nanogpt.model.GPT",
        "args": {
            "config": {"__type": "examples.nanogpt.model.GPTConfig", "n_layer": 1, "n_embd": 8, "n_head": 2}
        },
    },
    "optimizer": {"type": "torch.optim.SGD", "args": {"lr": 0.1}},
    "dataset": {"type": "tests.cli.common.CountingTokens", "train_args": {"size": 8}},
    "max_train_steps": 1,
    "seed": 0,
}
"""A valid config; each row changes one field (plus the `context` it needs)."""

# containers a row's path needs, filled with a valid value first
TEMPLATES: dict[str, Any] = {
    "model.parallel_modules": [
        {"type": "examples.nanogpt.model.Block", "forward_args_gen_fn": "tests.cli.common.block_inputs"}
    ],
    "log": [{"type": "TensorBoardLogger"}],
    "dataset_sampler": {"type": "torch.utils.data.DistributedSampler"},
    "lr_scheduler": {"type": "torch.optim.lr_scheduler.StepLR", "args": {"step_size": 1}},
    "checkpoint.resume_from": {"checkpoint": "last"},
    "hook": {"on_train_start": "builtins.print"},
    "model.parallel_modules.0.compute_config": {},
}


class Row(NamedTuple):
    value: Any
    why: str
    """What makes it wrong (wrong type, range, unknown name, contradiction, cannot apply)."""
    context: dict[str, Any] = {}
    """Other fields set with it (dotted paths)."""
    says: str = ""
    """Text the message must hold besides the field (default: nothing more)."""


def R(value: Any, why: str, context: dict[str, Any] | None = None, says: str = "") -> Row:
    return Row(value, why, context or {}, says)


NO_FN = "no_such_module_zz.fn"
NOT_CALLABLE = "tests.zoo.PARITY_MODELS"
PM = "model.parallel_modules.0."
PMC = PM + "compute_config."

INVALID: dict[str, list[Row]] = {
    "init_module": [R("no_such_module_zz", "unknown module")],
    "vars": [R([1, 2], "wrong type"), R({"a b": 1}, "not a name")],
    "compute_config": [
        R(None, "required"),
        R({"plan_ngpus": 0}, "out of range", says="plan_ngpus"),
        R({"plan_ngpus": 2, "runtime_ngpus": 3}, "contradiction", says="runtime_ngpus"),
        R(
            {"plan_ngpus": 1, "runtime_ngpus": 2, "use_end2end": False},
            "cannot apply: the trainer runs train_step",
        ),
        R({"plan_ngpus": 1, "gpus": 2}, "unknown name", says="gpus"),
    ],
    "gen_savedir": [
        R("", "empty"),
        R("tests/settings/test_trainer_args_table.py", "a file, not a directory"),
    ],
    "gen_reuse": [R("sometimes", "unknown name")],
    "pas_policy": [R("magic", "unknown name"), R(NO_FN, "unknown name"), R(NOT_CALLABLE, "not a function")],
    "broadcast_strategy": [R("some", "unknown name")],
    "verify": [R("maybe", "wrong type")],
    "instance_name": [R("a/b", "not one directory name"), R("..", "escapes gen_savedir")],
    "run_mode": [R("train", "unknown name")],
    "dummy_sample_gen_fn": [R(NO_FN, "unknown name"), R(NOT_CALLABLE, "not a function")],
    "tracing_from_weights": [R("/no/such/weights.ckpt", "missing file")],
    "model": [R("GPT", "wrong type")],
    "model.type": [R(None, "required"), R(NO_FN, "unknown name"), R("torch.optim.SGD", "not a Module")],
    "model.args": [R([1], "wrong type"), R({"cfg": {}}, "unknown argument of GPT")],
    "model.parallel_modules": [
        R("Block", "wrong type"),
        R([TEMPLATES["model.parallel_modules"][0]] * 2, "the same type twice"),
        R(
            [{**TEMPLATES["model.parallel_modules"][0], "type": "examples.nanogpt.model.GPT"}],
            "the model itself",
        ),
    ],
    "model.pretrained_path": [R("/no/such/dir", "missing directory")],
    "model.hf_prefix": [
        R("model.", "cannot apply without pretrained_path or export_hf"),
        R("model", "no trailing dot", {"checkpoint.export_hf": "/tmp/h5_hf_export_dir"}),
    ],
    PM + "type": [R(None, "required"), R(NO_FN, "unknown name"), R("torch.optim.SGD", "not a Module")],
    PM + "args": [R([1], "wrong type"), R({"cfg": 1}, "unknown argument of Block")],
    PM + "forward_args_gen_fn": [R(None, "required"), R(NO_FN, "unknown name")],
    PM + "tracing_from_weights": [
        R("/no/such/w.ckpt", "missing file"),
        R("/no/such/w.ckpt", "contradiction", {PM + "tracing_from_weights_prefix": "x."}),
    ],
    PM + "tracing_from_weights_prefix": [R("blocks.0.", "cannot apply without tracing_from_weights")],
    PM + "compute_config": [R("fast", "wrong type"), R({"gpus": 2}, "unknown name", says="gpus")],
    PM + "gen_savedir": [R("", "empty")],
    PM + "gen_reuse": [R("sometimes", "unknown name")],
    PM + "pas_policy": [R("magic", "unknown name")],
    PM + "broadcast_strategy": [R("some", "unknown name")],
    PM + "instance_name": [R("a/b", "not one directory name")],
    PM + "precision": [R("fp8", "unknown name")],
    PMC + "constant_folding": [R("maybe", "wrong type")],
    PMC + "trace_strategy": [R("psychic", "unknown name", says="trace_strategy")],
    PMC + "use_zero": [R("maybe", "wrong type")],
    PMC + "zero_ngroups": [R(-1, "out of range", says="zero_ngroups"), R("two", "wrong type")],
    PMC + "zero_use_reduce_scatter": [R("maybe", "wrong type")],
    PMC + "use_async_reducer": [R("maybe", "wrong type")],
    PMC + "reducer_bucket_cap_mb": [
        R("big", "wrong type"),
        R(-1.0, "out of range", says="reducer_bucket_cap_mb"),
    ],
    PMC + "pas_config": [R([1], "wrong type")],
    PMC + "user_config": [R([1], "wrong type")],
    PMC + "torch_compile": [R("yes", "wrong type", says="torch_compile")],
    "optimizer": [R("SGD", "wrong type")],
    "optimizer.type": [
        R(None, "required"),
        R(NO_FN, "unknown name"),
        R("torch.nn.Linear", "not an Optimizer"),
    ],
    "optimizer.args": [
        R({"lrr": 0.1}, "unknown argument", says="lrr"),
        R({"lr": -1.0}, "out of range", says="learning rate"),
        R({"lr": 0.1, "momentum": -0.5}, "out of range", says="momentum"),
        R({"params": []}, "set by the trainer"),
    ],
    "optimizer.clip_gnorm": [R(-1.0, "out of range"), R(float("nan"), "not finite"), R("big", "wrong type")],
    "optimizer.loss_reduction": [R("avg", "unknown name"), R("per-token-mean", "needs aggregate_outputs_fn")],
    "optimizer.grad_reduction": [R("avg", "unknown name"), R("per-token-mean", "needs aggregate_outputs_fn")],
    "optimizer.aggregate_outputs_fn": [R(NO_FN, "unknown name"), R(NOT_CALLABLE, "not a function")],
    "dataset": [R([1], "wrong type")],
    "dataset.type": [R(None, "required"), R(NO_FN, "unknown name")],
    "dataset.train_args": [R({"sizes": 8}, "unknown argument", says="sizes"), R([8], "wrong type")],
    "dataset.val_args": [R({"sizes": 8}, "unknown argument", says="sizes")],
    "dataset.test_args": [R({"sizes": 8}, "unknown argument", says="sizes")],
    "dataloader": [R(3, "wrong type")],
    "dataloader.type": [R(NO_FN, "unknown name"), R("", "empty")],
    "dataloader.train_args": [
        R({"batch_size": 4}, "set by the trainer"),
        R({"num_worker": 2}, "unknown argument", says="num_worker"),
        R({"shuffle": True}, "the sampler shuffles", says="dataset_sampler"),
        R({"sampler": None}, "set by the trainer"),
    ],
    "dataloader.val_args": [
        R({"batch_size": 4}, "set by the trainer"),
        R({"num_worker": 2}, "unknown argument"),
    ],
    "dataloader.test_args": [
        R({"batch_size": 4}, "set by the trainer"),
        R({"num_worker": 2}, "unknown argument"),
    ],
    "dataset_sampler": [R("random", "wrong type")],
    "dataset_sampler.type": [R("", "empty"), R(NO_FN, "unknown name")],
    "dataset_sampler.train_args": [
        R({"shufle": True}, "unknown argument"),
        R({"rank": 0}, "set by the trainer"),
    ],
    "dataset_sampler.val_args": [R({"num_replicas": 2}, "set by the trainer")],
    "dataset_sampler.test_args": [R({"shufle": False}, "unknown argument")],
    "lr_scheduler": [R("step", "wrong type")],
    "lr_scheduler.type": [R(None, "required"), R(NO_FN, "unknown name")],
    "lr_scheduler.args": [
        R({"step": 1}, "unknown argument", says="step"),
        R({"step_size": 1, "optimizer": None}, "set by the trainer"),
    ],
    "lr_scheduler.interval": [R("batch", "unknown name")],
    "checkpoint": [R(1, "wrong type")],
    "checkpoint.save_dir": [R("", "empty"), R("tests/settings/test_trainer_args_table.py", "a file")],
    "checkpoint.no_save": [R("maybe", "wrong type")],
    "checkpoint.save_type": [R("zip", "unknown name")],
    "checkpoint.save_last": [R("maybe", "wrong type")],
    "checkpoint.save_best": [R("maybe", "wrong type")],
    "checkpoint.symlink_best_and_last": [R("maybe", "wrong type")],
    "checkpoint.every_n_train_steps": [
        R(0, "out of range"),
        R(2, "contradiction", {"checkpoint.every_n_epochs": 1}),
    ],
    "checkpoint.every_n_epochs": [R(0, "out of range"), R("often", "wrong type")],
    "checkpoint.keep_last_n_checkpoints": [R(0, "out of range")],
    "checkpoint.resume_from": [R("/no/such/ckpt", "missing checkpoint")],
    "checkpoint.resume_from.checkpoint": [R("/no/such/ckpt", "missing checkpoint")],
    "checkpoint.resume_from.convert_fn": [R(NO_FN, "unknown name")],
    "checkpoint.resume_from.with_merged": [R("maybe", "wrong type")],
    "checkpoint.export_hf": [R("tests/settings/test_trainer_args_table.py", "a file, not a directory")],
    "log": [R("tensorboard", "wrong type")],
    "log.0.type": [R(None, "required"), R("NoSuchLogger", "unknown name")],
    "log.0.args": [R([1], "wrong type")],
    "hook": [R([1], "wrong type")],
    "hook.type": [R(NO_FN, "unknown name"), R("torch.nn.Linear", "not a TrainHook")],
    "hook.args": [R({"x": 1}, "unknown argument", {"hook.type": "nnscaler.cli.train_hook.TrainHook"})],
    "debug": [R(1, "wrong type")],
    "debug.check_gradient_sync_cross_devices": [R("maybe", "wrong type")],
    "precision": [R("fp8", "unknown name"), R({"weights": "fp16"}, "unknown name"), R(16, "wrong type")],
    "micro_batch_size": [R(0, "out of range"), R("four", "wrong type")],
    "global_batch_size": [R(-4, "out of range"), R(3, "not a multiple of micro x replicas")],
    "grad_accumulation_steps": [
        R(-1, "out of range"),
        R(3, "contradiction", {"global_batch_size": 4}, says="inconsistent"),
    ],
    "max_epochs": [R(-2, "out of range (-1: set up only, as nnScaler 0.8)"), R("many", "wrong type")],
    "max_train_steps": [
        R(-2, "out of range (-1: set up only, as nnScaler 0.8)"),
        R(None, "neither limit given", says="max_epochs"),
    ],
    "max_val_steps": [R(-1, "out of range"), R(5, "cannot apply: no validation set", says="val_args")],
    "val_every_n_train_steps": [
        R(-1, "out of range"),
        R(5, "cannot apply: no validation set", says="val_args"),
    ],
    "val_every_n_epochs": [R(-1, "out of range")],
    "enable_progress_bar": [R("maybe", "wrong type")],
    "log_progress_every_n_train_steps": [R(-1, "out of range")],
    "seed": [R(-1, "out of range"), R(2**40, "out of numpy's range"), R("zero", "wrong type")],
    "snapshot_every": [R(-1, "out of range"), R("often", "wrong type")],
    "snapshot_dir": [R("tests/settings/test_trainer_args_table.py", "a file, not a directory")],
    "init_env_fn": [R(NO_FN, "unknown name"), R(NOT_CALLABLE, "not a function")],
}
for _name in HOOK_NAMES:
    INVALID[f"hook.{_name}"] = [R(NO_FN, "unknown name"), R(NOT_CALLABLE, "not a function")]

ACCEPTED: dict[str, str] = {}
"""Fields whose every value applies (none so far: each has a type or a range to refuse)."""


# ---- walking the dataclasses -------------------------------------------------------------------


def _dataclasses_in(hint: Any) -> list[tuple[str, type]]:
    """(path suffix, dataclass) of the config dataclasses a field's type holds ('.0' for a list item)."""
    origin, targs = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return [x for a in targs for x in _dataclasses_in(a)]
    if origin is list:
        return [(".0" + s, c) for s, c in _dataclasses_in(targs[0])]
    if dataclasses.is_dataclass(hint) and hint is not ComputeConfig:  # ComputeConfig: H4's table
        return [("", hint)]
    return []


def field_paths(cls: type = TrainerArgs, prefix: str = "") -> list[str]:
    """Every field path below `cls` (nested config dataclasses walked, the hook union both ways)."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        path = prefix + f.name
        out.append(path)
        for suffix, sub in _dataclasses_in(hints[f.name]):
            out += field_paths(sub, f"{path}{suffix}.")
    return sorted(set(out))


def test_every_field_has_a_row() -> None:
    paths = set(field_paths())
    assert {
        "optimizer.args",
        "model.parallel_modules.0.compute_config.use_zero",
        "hook.on_train_start",
    } <= paths
    rows = set(INVALID) | set(ACCEPTED)
    assert not paths - rows, f"fields without a row (add invalid values or a reason): {sorted(paths - rows)}"
    assert not rows - paths, f"rows of fields that do not exist: {sorted(rows - paths)}"
    assert all(INVALID[p] for p in INVALID)


# ---- building a config with one field changed -----------------------------------------------


def _set(d: dict, path: str, value: Any) -> None:
    parts = path.split(".")
    node: Any = d
    for i, part in enumerate(parts[:-1]):
        so_far = ".".join(parts[: i + 1])
        key: Any = int(part) if isinstance(node, list) else part
        if isinstance(node, dict) and key not in node:
            node[key] = copy.deepcopy(TEMPLATES.get(so_far, {}))
        node = node[key]
    last = parts[-1]
    if isinstance(node, list):
        node[int(last)] = value
    elif value is None:
        node.pop(last, None)
    else:
        node[last] = value


def config_with(path: str, row: Row) -> dict[str, Any]:
    d = copy.deepcopy(BASE)
    if path.startswith("hook.") and path.split(".")[1] in ("type", "args"):
        d["hook"] = {"type": "nnscaler.cli.train_hook.TrainHook"}
    for p, v in row.context.items():
        _set(d, p, v)
    if path == "max_train_steps" and row.value is None:
        d.pop("max_train_steps")
        return d
    _set(d, path, row.value)
    if row.value is None and path.endswith(("compute_config", "type")) and path.count(".") <= 3:
        _null(d, path)
    return d


def _null(d: dict, path: str) -> None:
    """`None` means 'given as null' for a required field (deleting it would fall back to a default)."""
    parts = path.split(".")
    node: Any = d
    for part in parts[:-1]:
        node = node[int(part)] if isinstance(node, list) else node[part]
    node[parts[-1]] = None


def _hook_base_ok() -> None:
    assert isinstance(
        TrainerArgs.from_dict({**BASE, "hook": {"type": "nnscaler.cli.train_hook.TrainHook"}}).hook,
        HookConfig,
    )
    assert isinstance(TrainerArgs.from_dict({**BASE, "hook": TEMPLATES["hook"]}).hook, HookMapConfig)


def test_the_base_config_and_every_template_are_valid() -> None:
    TrainerArgs.from_dict(copy.deepcopy(BASE))
    for path, value in TEMPLATES.items():
        d = copy.deepcopy(BASE)
        _set(d, path, copy.deepcopy(value))
        TrainerArgs.from_dict(d)
    _hook_base_ok()


ROWS = [(path, row) for path, rows in INVALID.items() for row in rows]


@pytest.mark.parametrize(("path", "row"), ROWS, ids=[f"{p}={r.value!r}"[:80] for p, r in ROWS])
def test_an_invalid_value_is_refused_naming_the_field(path: str, row: Row) -> None:
    d = config_with(path, row)
    with pytest.raises(ConfigError) as err:
        TrainerArgs.from_dict(d)
    msg = str(err.value)
    leaf = path.rsplit(".", 1)[-1]
    named = path in msg or path.replace(".0.", "[") in msg or (leaf in msg and path.split(".")[0] in msg)
    assert named, f"{path}={row.value!r} ({row.why}): the message does not name the field: {msg}"
    assert row.says in msg, f"{path}={row.value!r}: expected {row.says!r} in {msg}"
