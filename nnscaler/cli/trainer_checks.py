"""The checks `TrainerArgs` runs once it is built: every field either applies or is refused.

Each refusal is a `ConfigError` naming the field by its dotted path (`optimizer.args.lrr`,
`model.parallel_modules.0.gen_reuse`) and the fix. Dotted names are loaded here (the Trainer loads them
anyway at setup, so a typo is reported before any process group or compile exists), and the keyword
arguments the config gives a class are bound against its signature.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
from pathlib import Path
from typing import Any

import torch

from nnscaler.cli.configs import HookConfig, HookMapConfig
from nnscaler.cli.loading import load_type
from nnscaler.cli.train_hook import HOOK_NAMES, TrainHook
from nnscaler.config import BroadcastGenFilesStrategy, ComputeConfig, ReuseType
from nnscaler.errors import ConfigError
from nnscaler.policies.options import POLICY_OPTIONS

__all__ = [
    "check_trainer_args",
    "check_loadable",
    "check_kwargs",
    "check_choice_fields",
    "agree_micro_batches",
]

SEED_MAX = 2**32 - 1
"""numpy's seed range (TrainerArgs.seed seeds torch, numpy and random)."""


def check_loadable(where: str, dotted: Any, kind: type | None = None, what: str = "") -> Any:
    """The object `dotted` names; ConfigError naming `where` when it does not load or is not a `kind`."""
    if dotted is None:
        return None
    try:
        obj = load_type(dotted)
    except (ConfigError, ImportError) as err:
        raise ConfigError(f"{where}: {err}") from None
    if kind is not None and not (isinstance(obj, type) and issubclass(obj, kind)):
        raise ConfigError(f"{where}: {dotted!r} is not {what or 'a subclass of ' + kind.__name__}")
    if kind is None and not callable(obj):
        raise ConfigError(f"{where}: {dotted!r} is not callable: name a {what or 'function or class'}")
    return obj


def check_kwargs(where: str, fn: Any, kwargs: dict[str, Any], *, given: tuple[str, ...] = ()) -> None:
    """Each key of `kwargs` is a parameter of `fn` (unless it takes **kwargs) and none is one the
    trainer passes itself (`given`)."""
    if not isinstance(kwargs, dict):
        raise ConfigError(f"{where}: expected a mapping of keyword arguments, got {kwargs!r}")
    for key in kwargs:
        if key in given:
            raise ConfigError(f"{where}.{key} is set by the trainer: leave it out")
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check against
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    names = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in kwargs:
        if key not in names:
            known = ", ".join(n for n in names if n not in given and n not in ("self", "params"))
            raise ConfigError(
                f"{where}.{key}: {getattr(fn, '__name__', fn)} takes no argument {key!r}; "
                + (f"it takes: {known}" if known else "it takes none: leave the args out")
            )


def _name_ok(where: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, str) or not value or value in (".", "..") or "/" in value or "\\" in value:
        raise ConfigError(f"{where}: {value!r} must be one directory name (no '/', not empty or '..')")


def _dir_ok(where: str, value: Any, *, required: bool = True) -> None:
    if value is None:
        return
    if isinstance(value, os.PathLike):  # a pathlib.Path, as nnScaler 0.8's tests give
        value = os.fspath(value)
    if not isinstance(value, str) or (required and not value.strip()):
        raise ConfigError(f"{where}: give a directory path, got {value!r}")
    if value and Path(value).is_file():
        raise ConfigError(f"{where}: {value} is a file; give a directory path")


def _policy_ok(where: str, value: Any) -> None:
    if value is None:
        return
    from nnscaler.policies.registry import BUILTIN_POLICIES

    if isinstance(value, str) and "." not in value:
        if value not in BUILTIN_POLICIES:
            raise ConfigError(
                f"{where}: {value!r} is not a built-in policy ({', '.join(sorted(BUILTIN_POLICIES))}) "
                "nor a dotted name of a policy function"
            )
        return
    check_loadable(where, value, what="policy function")


def check_choice_fields(prefix: str, obj: Any) -> None:
    """gen_reuse, broadcast_strategy, pas_policy, instance_name, gen_savedir, precision of TrainerArgs or
    of a ModuleParallelizeConfig (`prefix` the dotted path before them)."""
    from nnscaler.cli.arg_values import resolve_precision

    reuse = [e.value for e in ReuseType]
    if obj.gen_reuse is not None and obj.gen_reuse not in ("auto", *reuse):
        raise ConfigError(f"{prefix}gen_reuse must be 'auto' or one of {reuse}, got {obj.gen_reuse!r}")
    strategies = [e.value for e in BroadcastGenFilesStrategy]
    if obj.broadcast_strategy is not None and obj.broadcast_strategy not in strategies:
        raise ConfigError(
            f"{prefix}broadcast_strategy must be one of {strategies}, got {obj.broadcast_strategy!r}"
        )
    _policy_ok(f"{prefix}pas_policy", obj.pas_policy)
    _name_ok(f"{prefix}instance_name", obj.instance_name)
    _dir_ok(f"{prefix}gen_savedir", obj.gen_savedir)
    if obj.precision is not None:
        try:
            resolve_precision(obj.precision)
        except ConfigError as err:
            raise ConfigError(f"{prefix}{err}") from None


def _count(where: str, value: Any, low: int) -> None:
    if value is not None and value < low:
        raise ConfigError(f"{where} must be >= {low}, got {value}" + (" (0: off)" if low == 0 else ""))


def _file_ok(where: str, value: str | None) -> None:
    if value and not Path(value).exists():
        raise ConfigError(f"{where}: {value} does not exist")


def _optimizer(args: Any) -> None:
    cls = check_loadable("optimizer.type", args.optimizer.type, torch.optim.Optimizer)
    kwargs = args.create_kwarg(args.optimizer.args)
    check_kwargs("optimizer.args", cls, kwargs, given=("params",))
    if cls.__module__.startswith("torch.optim"):  # torch's own value checks (lr >= 0, betas in [0, 1), ...)
        try:
            cls([torch.nn.Parameter(torch.zeros(1))], **kwargs)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"optimizer.args: {cls.__name__} refuses {kwargs}: {err}") from None
    if not math.isfinite(args.optimizer.clip_gnorm):
        raise ConfigError(
            f"optimizer.clip_gnorm must be a finite number >= 0, got {args.optimizer.clip_gnorm}"
        )
    check_loadable("optimizer.aggregate_outputs_fn", args.optimizer.aggregate_outputs_fn)


def _data(args: Any) -> None:
    ds = check_loadable("dataset.type", args.dataset.type, what="dataset class or function")
    for stage in ("train", "val", "test"):
        check_kwargs(f"dataset.{stage}_args", ds, getattr(args.dataset, f"{stage}_args"))
    dl = check_loadable("dataloader.type", args.dataloader.type, what="data loader class")
    for stage in ("train", "val", "test"):
        kw = getattr(args.dataloader, f"{stage}_args")
        check_kwargs(f"dataloader.{stage}_args", dl, kw, given=("dataset", "batch_size", "sampler"))
        if "shuffle" in kw:
            raise ConfigError(
                f"dataloader.{stage}_args.shuffle: the sampler decides the order; set "
                f"dataset_sampler.{stage}_args.shuffle instead"
            )
    if args.dataset_sampler is not None:
        sp = check_loadable("dataset_sampler.type", args.dataset_sampler.type, what="sampler class")
        for stage in ("train", "val", "test"):
            kw = getattr(args.dataset_sampler, f"{stage}_args")
            check_kwargs(f"dataset_sampler.{stage}_args", sp, kw, given=("dataset", "num_replicas", "rank"))
    if not args.dataset.val_args:
        for name in ("val_every_n_train_steps", "max_val_steps"):
            if getattr(args, name):
                raise ConfigError(f"{name} is set but there is no validation set: give dataset.val_args")


def _model(args: Any) -> None:
    model = args.model
    cls = check_loadable("model.type", model.type, torch.nn.Module)
    check_kwargs("model.args", cls, model.args)
    if model.hf_prefix and not (model.pretrained_path or args.checkpoint.export_hf):
        raise ConfigError(
            "model.hf_prefix applies only with model.pretrained_path or checkpoint.export_hf: give one, "
            "or leave hf_prefix out"
        )
    if model.hf_prefix and not model.hf_prefix.endswith("."):
        raise ConfigError(f"model.hf_prefix {model.hf_prefix!r} must end with '.' (e.g. 'model.')")
    for i, m in enumerate(model.parallel_modules):
        where = f"model.parallel_modules.{i}."
        sub = check_loadable(f"{where}type", m.type, torch.nn.Module)
        check_loadable(f"{where}forward_args_gen_fn", m.forward_args_gen_fn)
        _file_ok(f"{where}tracing_from_weights", m.tracing_from_weights)
        if m.args is not None:
            check_kwargs(f"{where}args", sub, m.args)
        check_choice_fields(where, m)


def _checkpoint(args: Any) -> None:
    ckpt = args.checkpoint
    if not ckpt.no_save:
        _dir_ok("checkpoint.save_dir", ckpt.save_dir)
    if ckpt.export_hf is not None:
        _dir_ok("checkpoint.export_hf", ckpt.export_hf)
    if ckpt.resume_from is not None:
        check_loadable("checkpoint.resume_from.convert_fn", ckpt.resume_from.convert_fn)


def _hooks_and_logs(args: Any) -> None:
    for i, log in enumerate(args.log):
        cls = check_loadable(f"log.{i}.type", log.type, what="logger class")
        check_kwargs(f"log.{i}.args", cls, log.args)
    if isinstance(args.hook, HookConfig):
        cls = check_loadable("hook.type", args.hook.type, TrainHook)
        check_kwargs("hook.args", cls, args.hook.args)
    elif isinstance(args.hook, HookMapConfig):
        for name in HOOK_NAMES:
            check_loadable(f"hook.{name}", getattr(args.hook, name))


def check_trainer_args(args: Any) -> None:
    """All checks of a built TrainerArgs (its __post_init__ has done the per-field ones)."""
    check_choice_fields("", args)
    _file_ok("tracing_from_weights", args.tracing_from_weights)
    check_loadable("dummy_sample_gen_fn", args.dummy_sample_gen_fn)
    check_loadable("init_env_fn", args.init_env_fn)
    for name in ("max_epochs", "max_train_steps"):  # < 0: set up, train no step (nnScaler 0.8's tests)
        _count(name, getattr(args, name), -1 if getattr(args, name) == -1 else 0)
    for name in (
        "max_val_steps",
        "val_every_n_train_steps",
        "val_every_n_epochs",
        "log_progress_every_n_train_steps",
    ):
        _count(name, getattr(args, name), 0)
    if args.seed is not None and not 0 <= args.seed <= SEED_MAX:
        raise ConfigError(f"seed must be in [0, {SEED_MAX}] (numpy's range), got {args.seed}")
    if not isinstance(args.vars, dict) or not all(isinstance(k, str) and k.isidentifier() for k in args.vars):
        raise ConfigError(f"vars: expected a mapping of names (identifiers) to values, got {args.vars!r}")
    _model(args)
    _optimizer(args)
    _data(args)
    if args.lr_scheduler is not None:
        cls = check_loadable("lr_scheduler.type", args.lr_scheduler.type, what="scheduler class")
        check_kwargs("lr_scheduler.args", cls, args.lr_scheduler.args, given=("optimizer",))
    _checkpoint(args)
    _hooks_and_logs(args)


def agree_micro_batches(pas_policy: str, compute_config: ComputeConfig, accum: int) -> ComputeConfig:
    """`compute_config` whose policy plans the Trainer's micro-batches: a built-in policy that reads
    `pipeline_nmicros` (pp, hybrid, autodist) gets grad_accumulation_steps `accum` as that count, so a
    pipelined plan takes exactly the micro-batches one train_step is fed (nnScaler 0.8's Trainer passes its
    update_freq the same way). autodist still chooses whether to pipeline; only the count is fixed.
    A pas_config value that disagrees is refused naming both fields."""
    opts = POLICY_OPTIONS.get(pas_policy)
    if opts is None or "pipeline_nmicros" not in {f.name for f in dataclasses.fields(opts)}:
        return compute_config  # a custom policy, or one without pipelines
    pas = dict(compute_config.pas_config or {})
    for key in ("pipeline_nmicros", "update_freq"):
        given = pas.get(key)
        first = given[0] if isinstance(given, (list, tuple)) and given else given
        if first is not None and first != accum:
            raise ConfigError(
                f"compute_config.pas_config.{key} ({given!r}) disagrees with grad_accumulation_steps ({accum}): "
                f"a train_step runs grad_accumulation_steps micro-batches, and a pipeline takes "
                f"pas_config.{key} of them; drop pas_config.{key} (the Trainer passes grad_accumulation_steps "
                "to the policy) or set both to the same value"
            )
    if "pipeline_nmicros" in pas or "update_freq" in pas:
        return compute_config  # given, and equal
    pas["pipeline_nmicros"] = accum
    return dataclasses.replace(compute_config, pas_config=pas)
