"""The nested config dataclasses of `TrainerArgs` (nnScaler's names and fields).

Each field has a docstring; docs/trainer.md is generated from them (`python -m nnscaler.cli.docgen`).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from nnscaler.cli.arg_parser import NORMALIZE_KEY, TYPE_KEY
from nnscaler.cli.checkpoint_pointers import pointer_path
from nnscaler.cli.loading import load_type
from nnscaler.cli.train_hook import HOOK_NAMES, TrainHook
from nnscaler.config import ComputeConfig
from nnscaler.errors import ConfigError
from nnscaler.runtime.checkpoint.save_types import SAVE_TYPES

__all__ = [
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
    "ArgsTrainHook",
    "factory_normalize",
    "SAVE_TYPES",
]

logger = logging.getLogger(__name__)

REDUCTIONS = ("mean", "sum", "per-token-mean")


def factory_normalize(value: Any) -> Any:
    """`{__type: dotted.callable, **kwargs}` -> the callable's result; anything else unchanged."""
    if isinstance(value, dict) and TYPE_KEY in value:
        kwargs = {k: v for k, v in value.items() if k != TYPE_KEY}
        return load_type(value[TYPE_KEY])(**kwargs)
    return value


def _check_choice(where: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{where} must be one of {', '.join(map(repr, choices))}, got {value!r}")


@dataclass(frozen=True)
class OptionalComputeConfig:
    """Overrides of the global compute_config for one parallelized sub-module (None: keep)."""

    constant_folding: bool | None = None
    """See ComputeConfig.constant_folding."""
    trace_strategy: str | None = None
    """See ComputeConfig.trace_strategy."""
    use_zero: bool | None = None
    """See ComputeConfig.use_zero."""
    zero_ngroups: int | None = None
    """See ComputeConfig.zero_ngroups."""
    zero_use_reduce_scatter: bool | None = None
    """See ComputeConfig.zero_use_reduce_scatter."""
    use_async_reducer: bool | None = None
    """See ComputeConfig.use_async_reducer."""
    reducer_bucket_cap_mb: float | None = None
    """See ComputeConfig.reducer_bucket_cap_mb."""
    pas_config: dict[str, Any] | None = None
    """See ComputeConfig.pas_config."""
    user_config: dict[str, Any] | None = None
    """See ComputeConfig.user_config."""
    torch_compile: bool | dict[str, Any] | None = None
    """See ComputeConfig.torch_compile (e.g. compile only this sub-module's generated code)."""

    def resolve(self, compute_config: ComputeConfig) -> ComputeConfig:
        """`compute_config` with the non-None values of this one, and use_end2end off (a sub-module is
        called by the outer model's forward, not through train_step)."""
        values = compute_config.to_dict()
        values.update({k: v for k, v in asdict(self).items() if v is not None})
        values["use_end2end"] = False
        return ComputeConfig(**values)


@dataclass
class ModuleParallelizeConfig:
    """A sub-module of the model to parallelize on its own (the rest of the model stays plain)."""

    type: str | None = None
    """Dotted name of the sub-module's class (required)."""
    args: dict[str, Any] | None = None
    """Constructor keyword arguments (None: the arguments the outer model passes)."""
    forward_args_gen_fn: str | None = None
    """Dotted name of `fn(trainer_args) -> dict` giving dummy forward arguments (required)."""
    tracing_from_weights: str | None = None
    """A state-dict file to initialize the sub-module from before tracing."""
    tracing_from_weights_prefix: str | None = None
    """The sub-module's key prefix inside the model-level `tracing_from_weights` file."""
    compute_config: OptionalComputeConfig | None = None
    """Overrides of the global compute_config."""
    gen_savedir: str | None = None
    """Overrides TrainerArgs.gen_savedir."""
    gen_reuse: str | None = None
    """Overrides TrainerArgs.gen_reuse."""
    pas_policy: str | None = None
    """Overrides TrainerArgs.pas_policy."""
    broadcast_strategy: str | None = None
    """Overrides TrainerArgs.broadcast_strategy."""
    instance_name: str | None = field(default=None, metadata={NORMALIZE_KEY: factory_normalize})
    """Overrides TrainerArgs.instance_name (a `__type` factory is allowed)."""
    precision: Any = None
    """Overrides TrainerArgs.precision."""

    def __post_init__(self) -> None:
        if not self.type:
            raise ConfigError("model.parallel_modules[].type is required")
        if not self.forward_args_gen_fn:
            raise ConfigError(f"model.parallel_modules[{self.type}].forward_args_gen_fn is required")
        if self.tracing_from_weights and self.tracing_from_weights_prefix:
            raise ConfigError(
                "model.parallel_modules[].tracing_from_weights and tracing_from_weights_prefix exclude each other"
            )


@dataclass
class ModelConfig:
    """The model to train."""

    type: str | None = None
    """Dotted name of the model class (an nn.Module whose forward returns the loss first); required."""
    args: dict[str, Any] = field(default_factory=dict)
    """Constructor keyword arguments (`__type` factories and `$!(vars.x)` allowed)."""
    parallel_modules: list[ModuleParallelizeConfig] = field(default_factory=list)
    """Parallelize only these sub-modules (empty: the whole model)."""
    pretrained_path: str | None = None
    """A Hugging Face checkpoint directory (safetensors) loaded after parallelizing, each rank reading
    only its slices (`nnscaler.integration.hf.load_pretrained`); skipped when resuming a checkpoint."""
    hf_prefix: str = ""
    """Where the Hugging Face model sits in the model's state dict (e.g. "model." for `self.model =
    AutoModelForCausalLM...`), for pretrained_path and checkpoint.export_hf."""

    def __post_init__(self) -> None:
        types = [m.type for m in self.parallel_modules]
        if len(set(types)) != len(types):
            raise ConfigError(f"model.parallel_modules: each type may appear once, got {types}")
        if self.pretrained_path and not Path(self.pretrained_path).is_dir():
            raise ConfigError(f"model.pretrained_path: {self.pretrained_path} is not a directory")


@dataclass
class OptimizerConfig:
    """The optimizer, built on the parallel module by `nnscaler.build_optimizer`."""

    type: str | None = None
    """Dotted name of a torch.optim.Optimizer class (required)."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the optimizer (lr, weight_decay, ...)."""
    clip_gnorm: float = 0.0
    """Clip the total gradient norm to this value (0: no clipping; the norm is logged either way)."""
    loss_reduction: str = "mean"
    """How the training loss combines micro-batches and replicas: mean, sum or per-token-mean (the
    validation loss is always the mean over micro-batches, as in nnScaler 0.8)."""
    grad_reduction: str = "mean"
    """How gradients combine micro-batches: mean (of the global batch), sum or per-token-mean."""
    aggregate_outputs_fn: str | None = None
    """Dotted name of `fn(outputs, sync_group) -> AggregatedOutputs` (needed for per-token-mean)."""

    def __post_init__(self) -> None:
        _check_choice("optimizer.loss_reduction", self.loss_reduction, REDUCTIONS)
        _check_choice("optimizer.grad_reduction", self.grad_reduction, REDUCTIONS)
        for name in ("loss_reduction", "grad_reduction"):
            if getattr(self, name) == "per-token-mean" and not self.aggregate_outputs_fn:
                raise ConfigError(f"optimizer.{name}='per-token-mean' needs optimizer.aggregate_outputs_fn")
        if self.clip_gnorm < 0:
            raise ConfigError(f"optimizer.clip_gnorm must be >= 0, got {self.clip_gnorm}")


@dataclass
class DatasetConfig:
    """The datasets; val/test exist only when their args are given."""

    type: str | None = None
    """Dotted name of a torch Dataset class (required)."""
    train_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the training dataset."""
    val_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the validation dataset (empty: no validation)."""
    test_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the test dataset (empty: none)."""


@dataclass
class DataloaderConfig:
    """The data loaders; `batch_size` is set by the trainer (micro_batch_size)."""

    type: str = "torch.utils.data.DataLoader"
    """Dotted name of the loader class."""
    train_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments (num_workers, collate_fn as a dotted name, drop_last, ...)."""
    val_args: dict[str, Any] = field(default_factory=dict)
    """For validation (empty: train_args)."""
    test_args: dict[str, Any] = field(default_factory=dict)
    """For test (empty: train_args)."""

    def __post_init__(self) -> None:
        for stage in ("train", "val", "test"):
            if "batch_size" in getattr(self, f"{stage}_args"):
                raise ConfigError(
                    f"dataloader.{stage}_args.batch_size is set by the trainer: use micro_batch_size instead"
                )


@dataclass
class DatasetSamplerConfig:
    """The sampler that splits data among data-parallel replicas (num_replicas and rank are set)."""

    type: str = "torch.utils.data.DistributedSampler"
    """Dotted name of the sampler class."""
    train_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments (shuffle, drop_last, ...); the seed defaults to TrainerArgs.seed."""
    val_args: dict[str, Any] = field(default_factory=dict)
    """For validation (empty: no shuffle)."""
    test_args: dict[str, Any] = field(default_factory=dict)
    """For test (empty: no shuffle)."""


@dataclass
class LRSchedulerConfig:
    """A learning-rate scheduler stepped every optimizer step or every epoch."""

    type: str | None = None
    """Dotted name of a torch.optim.lr_scheduler class (required)."""
    args: dict[str, Any] = field(default_factory=dict)
    """Its keyword arguments."""
    interval: str = "epoch"
    """When it steps: 'step' (after each optimizer step) or 'epoch'."""

    def __post_init__(self) -> None:
        _check_choice("lr_scheduler.interval", self.interval, ("epoch", "step"))


@dataclass
class ResumeOptions:
    """Where to resume from."""

    checkpoint: str | None = field(default="last", metadata={NORMALIZE_KEY: factory_normalize})
    """'last', 'best' (under checkpoint.save_dir) or a checkpoint directory or merged file."""
    convert_fn: str | None = None
    """Dotted name of `fn(checkpoint: dict) -> dict` applied to each loaded checkpoint."""
    with_merged: bool | None = None
    """Load through a merged state (needed when the plan or GPU count changed; None: decide by metadata)."""


@dataclass
class CheckpointConfig:
    """When and how to save checkpoints, and what to resume from."""

    save_dir: str = "./checkpoints"
    """Directory of the checkpoints: `{epoch:04d}-{step:04d}/`, `last`, `best`."""
    no_save: bool = False
    """Save nothing."""
    save_type: str = "sharded"
    """sharded (every rank its own file), deduped (no replicated tensors) or merged (one file)."""
    save_last: bool = True
    """Keep `last` pointing at the newest checkpoint."""
    save_best: bool = True
    """Keep `best` pointing at the checkpoint with the lowest validation (else training) loss."""
    symlink_best_and_last: bool = True
    """`last`/`best` are directories of relative symlinks to a step's files (False: of copies)."""
    every_n_train_steps: int | None = None
    """Save every N optimizer steps."""
    every_n_epochs: int | None = None
    """Save every N epochs (default 1 when neither is given)."""
    keep_last_n_checkpoints: int | None = None
    """Delete older step checkpoints beyond the newest N (`best` is kept)."""
    resume_from: ResumeOptions | None = field(
        default=None, metadata={NORMALIZE_KEY: lambda x: {"checkpoint": x} if isinstance(x, str) else x}
    )
    """Resume from this checkpoint (a string is the checkpoint option)."""
    export_hf: str | None = None
    """At the end of training, write the model as a Hugging Face checkpoint directory here (safetensors
    and config.json; `nnscaler.integration.hf.save_pretrained`, under model.hf_prefix)."""

    def __post_init__(self) -> None:
        if isinstance(self.resume_from, str):
            self.resume_from = ResumeOptions(checkpoint=self.resume_from)
        ckpt = self.resume_from.checkpoint if self.resume_from else None
        if ckpt and ckpt not in ("last", "best") and not Path(ckpt).exists():
            raise ConfigError(f"checkpoint.resume_from: {ckpt} does not exist")
        if self.no_save:
            return
        _check_choice("checkpoint.save_type", self.save_type, SAVE_TYPES)
        if not self.save_dir:
            raise ConfigError("checkpoint.save_dir is required (or set checkpoint.no_save)")
        if self.every_n_epochs is not None and self.every_n_train_steps is not None:
            raise ConfigError("checkpoint: give every_n_epochs or every_n_train_steps, not both")
        if self.every_n_epochs is None and self.every_n_train_steps is None:
            self.every_n_epochs = 1
        for name in ("every_n_train_steps", "every_n_epochs", "keep_last_n_checkpoints"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"checkpoint.{name} must be >= 1, got {value}")

    def get_resume_checkpoint(self) -> Path | None:
        """The checkpoint to resume from, or None (nothing asked, or no `last`/`best` yet)."""
        if not self.resume_from or not self.resume_from.checkpoint:
            return None
        if self.resume_from.checkpoint in ("last", "best"):  # recovers from a crash while it was repointed
            return pointer_path(Path(self.save_dir), self.resume_from.checkpoint)
        return Path(self.resume_from.checkpoint)


@dataclass
class LogConfig:
    """A logger: TensorBoardLogger, WandbLogger or a dotted LoggerBase subclass."""

    type: str | None = None
    """Logger class; a bare name is looked up in nnscaler.cli.loggers."""
    args: dict[str, Any] = field(default_factory=dict)
    """Its keyword arguments (e.g. root_dir, name)."""

    def __post_init__(self) -> None:
        if not self.type:
            raise ConfigError("log[].type is required (e.g. TensorBoardLogger)")
        if isinstance(self.type, str) and "." not in self.type:
            self.type = f"nnscaler.cli.loggers.{self.type}"


@dataclass
class DebugConfig:
    """Checks that cost time."""

    check_gradient_sync_cross_devices: bool = True
    """Accepted for compatibility (gradient sync is checked by the runtime's own preflight)."""


@dataclass
class HookConfig:
    """A TrainHook subclass."""

    type: str | None = None
    """Dotted name of the TrainHook subclass."""
    args: dict[str, Any] = field(default_factory=dict)
    """Its constructor's keyword arguments."""


@dataclass
class HookMapConfig:
    """Plain functions as hooks: each field is a dotted function name called as fn(trainer, ...)."""

    after_setup: str | None = None
    on_finalize: str | None = None
    on_train_start: str | None = None
    on_train_end: str | None = None
    on_val_start: str | None = None
    on_val_end: str | None = None
    on_epoch_start: str | None = None
    on_epoch_end: str | None = None
    on_step_start: str | None = None
    on_step_end: str | None = None
    on_train_step_start: str | None = None
    on_train_step_end: str | None = None
    on_val_step_start: str | None = None
    on_val_step_end: str | None = None
    after_aggregate_train_step_outputs: str | None = None
    after_aggregate_val_step_outputs: str | None = None
    before_zero_grad: str | None = None
    after_zero_grad: str | None = None
    before_sync_grad: str | None = None
    after_sync_grad: str | None = None
    before_gnorm_clip: str | None = None
    after_gnorm_clip: str | None = None
    before_optimizer_step: str | None = None
    after_optimizer_step: str | None = None
    before_log_train_metrics: str | None = None
    before_log_val_metrics: str | None = None
    on_load_checkpoint: str | None = None
    after_load_checkpoint: str | None = None
    on_save_checkpoint: str | None = None


assert tuple(f.name for f in fields(HookMapConfig)) == HOOK_NAMES


class ArgsTrainHook(TrainHook):
    """A TrainHook whose hooks are the functions a HookMapConfig names."""

    def __init__(self, hook_config: HookMapConfig):
        self.config = hook_config
        for name in HOOK_NAMES:
            if dotted := getattr(hook_config, name):
                setattr(self, name, load_type(dotted))
