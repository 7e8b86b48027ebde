"""`TrainerArgs`: everything a training run needs, from a YAML file, a dict or the command line.

    args = TrainerArgs.from_cli(["-f", "cfg.yaml", "--compute_config.plan_ngpus", "2"])
    args = TrainerArgs.from_yaml("cfg.yaml")
    args = TrainerArgs.from_dict({...})

Field names follow nnScaler v0.8. The nested dataclasses are in nnscaler.cli.configs (re-exported
here); the grammar of the command line is in nnscaler.cli.arg_parser; precision names and the
batch-size arithmetic are in nnscaler.cli.arg_values.
"""

from __future__ import annotations

import copy
import importlib
import logging
import os
import random
from dataclasses import asdict, dataclass, field
from typing import Any, Union

import torch

from nnscaler.cli.aggregate import AggregatedOutputs
from nnscaler.cli.arg_parser import (
    DESERIALIZE_KEY,
    NORMALIZE_KEY,
    SKIP_DESERIALIZATION_KEY,
    TYPE_KEY,
    VALUE_KEY,
    VALUE_TYPE_KEY,
    deserialize_dataclass,
    merge_args,
    resolve_args,
)
from nnscaler.cli.arg_values import PRECISIONS, resolve_batch_sizes, resolve_precision
from nnscaler.cli.configs import (
    ArgsTrainHook,
    CheckpointConfig,
    DataloaderConfig,
    DatasetConfig,
    DatasetSamplerConfig,
    DebugConfig,
    HookConfig,
    HookMapConfig,
    LogConfig,
    LRSchedulerConfig,
    ModelConfig,
    ModuleParallelizeConfig,
    OptimizerConfig,
    OptionalComputeConfig,
    ResumeOptions,
    factory_normalize,
)
from nnscaler.cli.loading import TypeLoadError, load_type
from nnscaler.cli.train_hook import TrainHook
from nnscaler.cli.trainer_checks import agree_micro_batches, check_trainer_args
from nnscaler.cli.trainer_view import TrainerView
from nnscaler.cli.yaml_loader import read_yaml
from nnscaler.config import BroadcastGenFilesStrategy, ComputeConfig, ReuseType
from nnscaler.errors import ConfigError

__all__ = [
    "TrainerArgs",
    "AggregatedOutputs",
    "ComputeConfig",
    "OptionalComputeConfig",
    "ModuleParallelizeConfig",
    "ModelConfig",
    "OptimizerConfig",
    "DatasetConfig",
    "DataloaderConfig",
    "DatasetSamplerConfig",
    "LRSchedulerConfig",
    "ResumeOptions",
    "CheckpointConfig",
    "LogConfig",
    "DebugConfig",
    "HookConfig",
    "HookMapConfig",
    "load_type",
    "TypeLoadError",
    "PRECISIONS",
]

logger = logging.getLogger(__name__)


def _deserialize_hook(value: Any) -> Union[HookConfig, HookMapConfig, None]:
    if value is None or isinstance(value, (HookConfig, HookMapConfig)):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"hook must be a mapping (type/args, or hook names to functions), got {value!r}")
    if "type" in value or "args" in value:
        return deserialize_dataclass(value, HookConfig, _where="hook")
    return deserialize_dataclass(value, HookMapConfig, _where="hook")


@dataclass
class TrainerArgs:
    """A training run (nnScaler's TrainerArgs). Required: compute_config, model.type,
    optimizer.type, dataset.type, and max_epochs or max_train_steps."""

    init_module: str | None = None
    """A module imported before the config is read (registers custom ops, types, ...)."""
    vars: dict[str, Any] = field(default_factory=dict)
    """Free variables for `$(vars.x)` references and `$!(vars.x)` objects."""
    compute_config: ComputeConfig | None = None
    """How to parallelize (plan_ngpus, runtime_ngpus, use_zero, pas_config, ...); use_end2end is on."""
    gen_savedir: str = "./.nnscaler"
    """Where generated code goes."""
    gen_reuse: str = "auto"
    """match, override, moo or graph; auto: moo for compile, match for run."""
    pas_policy: str = "autodist"
    """Built-in policy name (dp, tp, data, pp, hybrid, autodist) or dotted name of a policy function."""
    broadcast_strategy: str = "all"
    """How generated files reach the other ranks: none, all, no_weights, code."""
    verify: bool | None = None
    """Check the captured program against the model on the dummy sample when generating code
    (parallelize's `verify`): null: when the weights are real and under 200M parameters; true; false."""
    instance_name: str | None = field(default=None, metadata={NORMALIZE_KEY: factory_normalize})
    """Instance directory name under gen_savedir (a `__type` factory is allowed); unset: `trainer`."""
    run_mode: str = "run"
    """run (compile and train) or compile (write the generated code and exit)."""
    dummy_sample_gen_fn: str | None = None
    """Dotted name of `fn(trainer_args) -> sample` used for tracing (default: the first train sample)."""
    tracing_from_weights: str | None = None
    """A state-dict file to initialize the model from before tracing."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The optimizer, gradient clipping and reductions."""
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    """The datasets."""
    dataloader: DataloaderConfig = field(default_factory=DataloaderConfig)
    """The data loaders."""
    dataset_sampler: DatasetSamplerConfig | None = None
    """The samplers (None: DistributedSampler with shuffle and seed)."""
    lr_scheduler: LRSchedulerConfig | None = None
    """The learning-rate scheduler (None: constant)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving and resuming."""
    log: list[LogConfig] = field(default_factory=list)
    """Loggers."""
    hook: Union[HookConfig, HookMapConfig, None] = field(
        default=None, metadata={DESERIALIZE_KEY: _deserialize_hook}
    )
    """A TrainHook class (type/args) or a map of hook name -> dotted function."""
    debug: DebugConfig = field(default_factory=DebugConfig)
    """Debug checks."""
    precision: Any = field(default=None, metadata={SKIP_DESERIALIZATION_KEY: True})
    """fp32/fp16/bf16/none, or a mapping over param/buffer/input (none: leave as built)."""
    micro_batch_size: int = 1
    """Samples per micro-batch on one data-parallel replica."""
    global_batch_size: int | None = None
    """Samples per optimizer step over all replicas = micro_batch_size x replicas x grad_accumulation_steps."""
    grad_accumulation_steps: int | None = None
    """Micro-batches per optimizer step on one replica (any two of the three batch fields give the third)."""
    max_epochs: int | None = None
    """Stop after this many epochs."""
    max_train_steps: int | None = None
    """Stop after this many optimizer steps (whichever limit comes first)."""
    max_val_steps: int | None = None
    """Validate on at most this many steps."""
    val_every_n_train_steps: int | None = None
    """Validate every N optimizer steps."""
    val_every_n_epochs: int | None = 1
    """Validate every N epochs."""
    enable_progress_bar: bool = True
    """A tqdm progress bar on interactive terminals (elsewhere a summary line every N steps)."""
    log_progress_every_n_train_steps: int | None = 100
    """The summary line's period when there is no progress bar."""
    seed: int | None = None
    """Seeds torch, numpy and random on every rank (same model init everywhere) and the samplers."""
    init_env_fn: str | None = None
    """Dotted name of `fn(trainer)` called at setup (after seeding)."""
    snapshot_every: int | None = None
    """Elastic training: copy each rank's training state to host memory (tmpfs) every N optimizer steps,
    with a peer copy on another node, so a restart under torchrun's elastic agent resumes from it (0: off;
    None: under torchrun with --max-restarts above 0, every step where a snapshot costs at most 5% of a
    step, else the smallest interval where it does; off elsewhere; see docs/elastic.md)."""
    snapshot_dir: str | None = None
    """This node's in-memory snapshot directory (default $NNSCALER_SNAPSHOT_DIR, else
    /dev/shm/nnscaler-snapshots/uid{uid}-{torchrun's --rdzv-id})."""

    def __post_init__(self) -> None:
        if self.init_module is not None:
            try:
                importlib.import_module(self.init_module)
            except ImportError as err:
                raise ConfigError(f"init_module: cannot import {self.init_module!r} ({err})") from None
        if self.compute_config is None:
            raise ConfigError("compute_config is required (at least compute_config.plan_ngpus)")
        if isinstance(self.compute_config, dict):
            self.compute_config = ComputeConfig(**self.compute_config)
        if not self.compute_config.use_end2end:
            raise ConfigError(
                "compute_config.use_end2end must be True: the trainer runs train_step (leave it out to get True)"
            )
        self.global_batch_size, self.grad_accumulation_steps = resolve_batch_sizes(
            self.micro_batch_size, self.global_batch_size, self.grad_accumulation_steps, self.compute_config
        )
        self.compute_config = agree_micro_batches(
            self.pas_policy, self.compute_config, self.grad_accumulation_steps
        )  # the policy plans the micro-batches train_step is fed
        if self.snapshot_every is not None and self.snapshot_every < 0:
            raise ConfigError(f"snapshot_every must be >= 0 (0: no snapshots), got {self.snapshot_every}")
        if self.snapshot_dir is not None and os.path.isfile(self.snapshot_dir):
            raise ConfigError(f"snapshot_dir: {self.snapshot_dir} is a file; give a directory path")
        if self.run_mode not in ("run", "compile"):
            raise ConfigError(f"run_mode must be 'run' or 'compile', got {self.run_mode!r}")
        reuse_values = [e.value for e in ReuseType]
        if self.gen_reuse == "auto":
            self.gen_reuse = "moo" if self.run_mode == "compile" else "match"
        elif self.gen_reuse not in reuse_values:
            raise ConfigError(f"gen_reuse must be 'auto' or one of {reuse_values}, got {self.gen_reuse!r}")
        strategies = [e.value for e in BroadcastGenFilesStrategy]
        if self.broadcast_strategy not in strategies:
            raise ConfigError(
                f"broadcast_strategy must be one of {strategies}, got {self.broadcast_strategy!r}"
            )
        self.precision = resolve_precision(self.precision)
        if not self.max_epochs and not self.max_train_steps:
            raise ConfigError("max_epochs or max_train_steps is required")
        for name in ("model", "optimizer", "dataset"):
            if not getattr(self, name).type:
                raise ConfigError(f"{name}.type is required (a dotted name, e.g. {_EXAMPLES[name]})")
        if not self.dataloader.type:
            raise ConfigError("dataloader.type is required")
        if self.dataset_sampler is not None and not self.dataset_sampler.type:
            raise ConfigError("dataset_sampler.type is required")
        if self.lr_scheduler is not None and not self.lr_scheduler.type:
            raise ConfigError("lr_scheduler.type is required (e.g. torch.optim.lr_scheduler.StepLR)")
        for m in self.model.parallel_modules:
            if m.type == self.model.type:
                raise ConfigError(
                    f"model.parallel_modules: {m.type} is the model itself; leave parallel_modules empty instead"
                )
            if m.compute_config is not None:
                try:
                    m.compute_config.resolve(self.compute_config)
                except ConfigError as err:
                    raise ConfigError(f"model.parallel_modules[{m.type}].compute_config: {err}") from None
            if m.tracing_from_weights_prefix and not self.tracing_from_weights:
                raise ConfigError(
                    "tracing_from_weights is required with model.parallel_modules[].tracing_from_weights_prefix"
                )
        if isinstance(self.hook, dict):
            self.hook = _deserialize_hook(self.hook)
        if self.seed is None and self.init_env_fn is None:
            logger.warning("neither seed nor init_env_fn is set: runs are not reproducible")
        self._vars = self.create_kwarg(self.vars) if isinstance(self.vars, dict) else self.vars
        check_trainer_args(self)  # names, kwargs and ranges of every field (nnscaler.cli.trainer_checks)

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def from_cli(cls, argv: list[str]) -> TrainerArgs:
        """`-f cfg.yaml` (optional, first) then `--a.b.c value` overrides; `--key!` deletes a key."""
        d: dict[str, Any] = {}
        argv = list(argv)
        if argv and argv[0] in ("-f", "--config"):
            if len(argv) < 2:
                raise ConfigError("-f needs a config file: -f cfg.yaml")
            d = _read_yaml(argv[1])
            argv = argv[2:]
        elif "-f" in argv:
            raise ConfigError("-f cfg.yaml must come first, before the --key value overrides")
        merge_args(d, argv)
        resolve_args(d)
        return cls.from_dict(d)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainerArgs:
        """Build from a nested dict (values may be strings; they are converted by type hints)."""
        d = copy.deepcopy(d)
        if init_module := d.get("init_module"):
            try:
                importlib.import_module(init_module)
            except ImportError as err:
                raise ConfigError(f"init_module: cannot import {init_module!r} ({err})") from None
        cc = d.get("compute_config")
        if isinstance(cc, dict) and cc.get("use_end2end") is None:
            cc["use_end2end"] = True
        return deserialize_dataclass(d, cls)

    @classmethod
    def from_yaml(cls, path: str) -> TrainerArgs:
        """Read a YAML config (with `$(...)` references resolved)."""
        return cls.from_cli(["-f", str(path)])

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (callables by their dotted names) that from_dict turns back into these args."""
        return _plain(asdict(self))

    # ---- objects from the config --------------------------------------------------------------

    def create_kwarg(self, value: Any) -> Any:
        """Build objects in an args value: `{__type: f, **kw}` -> f(**kw); `{__value_type: t, value: v}`
        -> t(v) (`function`: the function named v); `$!(self)` -> these args; `$!(vars.x)` -> vars x."""
        if isinstance(value, dict):
            value = {k: self.create_kwarg(v) for k, v in value.items()}
            if TYPE_KEY in value:
                return load_type(value.pop(TYPE_KEY))(**value)
            if VALUE_TYPE_KEY in value:
                if VALUE_KEY not in value:
                    raise ConfigError(f"'{VALUE_KEY}' is required next to '{VALUE_TYPE_KEY}' in {value!r}")
                vt = value[VALUE_TYPE_KEY]
                if vt == "function":
                    return load_type(value[VALUE_KEY])
                return load_type(vt)(value[VALUE_KEY])
            return value
        if isinstance(value, list):
            return [self.create_kwarg(v) for v in value]
        if isinstance(value, tuple):
            return tuple(self.create_kwarg(v) for v in value)
        if isinstance(value, str) and len(value) > 4 and value[:3] in ("$!(", "$!{") and value[-1] in ")}":
            ref = value[3:-1]
            if ref == "self":
                return self
            parts = ref.split(".")
            if parts[0] != "vars":
                raise ConfigError(f"{value}: a $!(...) reference must be $!(self) or $!(vars.x)")
            return self.get_resolved_var(".".join(parts[1:]))
        return value

    def get_resolved_var(self, fqn: str) -> Any:
        """The built value of vars entry `fqn` (dotted)."""
        var: Any = self._vars
        for part in fqn.split("."):
            if not isinstance(var, dict) or part not in var:
                raise ConfigError(f"vars.{fqn} is not defined")
            var = var[part]
        return var

    @property
    def model_type(self) -> type[torch.nn.Module]:
        m = load_type(self.model.type)
        if not isinstance(m, type) or not issubclass(m, torch.nn.Module):
            raise ConfigError(f"model.type {self.model.type!r} must name a torch.nn.Module subclass")
        return m

    def create_model(self) -> torch.nn.Module:
        return self.model_type(**self.create_kwarg(self.model.args))

    def create_dataset(self, stage: str = "train") -> Any:
        """The dataset of `stage`; None for val/test without args."""
        kwargs = getattr(self.dataset, f"{stage}_args")
        if not kwargs and stage != "train":
            return None
        return load_type(self.dataset.type)(**self.create_kwarg(kwargs))

    def create_sampler(self, dataset: Any, stage: str, num_replicas: int, rank: int) -> Any:
        """A sampler giving replica `rank` of `num_replicas` its share (None for an IterableDataset)."""
        if isinstance(dataset, torch.utils.data.IterableDataset):
            return None
        cfg = self.dataset_sampler or DatasetSamplerConfig()
        kwargs = dict(self.create_kwarg(getattr(cfg, f"{stage}_args")))
        if not kwargs and stage != "train":
            kwargs = {"shuffle": False}
        if self.seed is not None:
            kwargs.setdefault("seed", self.seed)
        return load_type(cfg.type)(dataset, num_replicas=num_replicas, rank=rank, **kwargs)

    def create_dataloader(self, stage: str, dataset: Any, sampler: Any) -> Any:
        kwargs = getattr(self.dataloader, f"{stage}_args") or self.dataloader.train_args
        kwargs = dict(self.create_kwarg(kwargs))
        if isinstance(kwargs.get("collate_fn"), str):
            kwargs["collate_fn"] = load_type(kwargs["collate_fn"])
        return load_type(self.dataloader.type)(
            dataset, batch_size=self.micro_batch_size, sampler=sampler, **kwargs
        )

    def create_parallel_optimizer(self, parallel_model: torch.nn.Module) -> torch.optim.Optimizer:
        from nnscaler.runtime import build_optimizer

        return build_optimizer(
            parallel_model, load_type(self.optimizer.type), **self.create_kwarg(self.optimizer.args)
        )

    def create_lr_scheduler(self, optimizer: torch.optim.Optimizer) -> Any:
        if self.lr_scheduler is None:
            return None
        return load_type(self.lr_scheduler.type)(optimizer, **self.create_kwarg(self.lr_scheduler.args))

    def create_loggers(self) -> list[Any]:
        return [load_type(c.type)(**self.create_kwarg(c.args)) for c in self.log]

    def create_hook(self) -> TrainHook:
        if self.hook is None:
            return TrainHook()
        if isinstance(self.hook, HookConfig):
            return load_type(self.hook.type)(**self.create_kwarg(self.hook.args))
        return ArgsTrainHook(self.hook)

    def init_env(self, trainer: TrainerView) -> None:
        """Seed every generator; then call init_env_fn."""
        if self.seed is not None:
            import numpy as np

            torch.manual_seed(self.seed)
            np.random.seed(self.seed)
            random.seed(self.seed)
        if self.init_env_fn:
            load_type(self.init_env_fn)(trainer)

    # ---- derived values -------------------------------------------------------------------------

    @property
    def scaling_factor(self) -> int:
        """Data-parallel replicas: runtime_ngpus // plan_ngpus."""
        return self.compute_config.runtime_ngpus // self.compute_config.plan_ngpus

    @property
    def update_freq(self) -> int:
        """Micro-batches per optimizer step on one replica."""
        return self.global_batch_size // self.micro_batch_size // self.scaling_factor

    @property
    def compile_mode(self) -> bool:
        return self.run_mode == "compile"

    @property
    def enable_log_progress(self) -> bool:
        return not self.enable_progress_bar and bool(self.log_progress_every_n_train_steps)

    @property
    def param_dtype(self) -> torch.dtype | None:
        return PRECISIONS[self.precision["param"]]

    @property
    def buffer_dtype(self) -> torch.dtype | None:
        return PRECISIONS[self.precision["buffer"]]

    @property
    def input_dtype(self) -> torch.dtype | None:
        return PRECISIONS[self.precision["input"]]

    @property
    def resolved_pas_policy(self) -> Any:
        """A built-in policy name as is; anything dotted loaded as a function."""
        return load_type(self.pas_policy) if "." in self.pas_policy else self.pas_policy

    @property
    def resolved_aggregate_outputs_fn(self) -> Any:
        return load_type(self.optimizer.aggregate_outputs_fn) if self.optimizer.aggregate_outputs_fn else None

    @property
    def resolved_dummy_sample_gen_fn(self) -> Any:
        return load_type(self.dummy_sample_gen_fn) if self.dummy_sample_gen_fn else None


_EXAMPLES = {
    "model": "examples.nanogpt.model.GPT",
    "optimizer": "torch.optim.AdamW",
    "dataset": "my_pkg.MyDataset",
}


def _read_yaml(path: str) -> dict[str, Any]:
    return read_yaml(path)  # refuses a key given twice (nnscaler.cli.yaml_loader)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{value.__module__}.{value.__qualname__}"
    return value
