"""Hooks into the training loop, with nnScaler's hook names.

Subclass `TrainHook` and override what you need (name it in the config as `hook: {type: my.Hook,
args: {...}}`), or give plain functions by dotted name (`hook: {on_train_start: my.fn, ...}`, a
`HookMapConfig`); each is called with the trainer first (typed as `TrainerView`, the Protocol
the Trainer satisfies), then the arguments listed below.
"""

from __future__ import annotations

from typing import Any

from nnscaler.cli.trainer_view import TrainerView

__all__ = ["TrainHook", "AggregatedTrainHook", "HOOK_NAMES"]

HOOK_NAMES = (
    "after_setup",
    "on_finalize",
    "on_train_start",
    "on_train_end",
    "on_val_start",
    "on_val_end",
    "on_epoch_start",
    "on_epoch_end",
    "on_step_start",
    "on_step_end",
    "on_train_step_start",
    "on_train_step_end",
    "on_val_step_start",
    "on_val_step_end",
    "after_aggregate_train_step_outputs",
    "after_aggregate_val_step_outputs",
    "before_zero_grad",
    "after_zero_grad",
    "before_sync_grad",
    "after_sync_grad",
    "before_gnorm_clip",
    "after_gnorm_clip",
    "before_optimizer_step",
    "after_optimizer_step",
    "before_log_train_metrics",
    "before_log_val_metrics",
    "on_load_checkpoint",
    "after_load_checkpoint",
    "on_save_checkpoint",
)
"""Every hook, in the order a run meets them (roughly)."""


class TrainHook:
    """Does nothing by default; override the hooks you need."""

    def after_setup(self, trainer: TrainerView) -> None:
        """The model, optimizer, data and checkpoint are ready; training has not started."""

    def on_finalize(self, trainer: TrainerView) -> None:
        """The run is over (also after an error); loggers are about to close."""

    def on_train_start(self, trainer: TrainerView) -> None:
        """Before the first epoch."""

    def on_train_end(self, trainer: TrainerView) -> None:
        """After the last step."""

    def on_val_start(self, trainer: TrainerView) -> None:
        """Before a validation pass."""

    def on_val_end(self, trainer: TrainerView, val_loss: float) -> None:
        """After a validation pass, with its loss."""

    def on_epoch_start(self, trainer: TrainerView, epoch: int) -> None:
        """Before epoch `epoch` (from 0)."""

    def on_epoch_end(self, trainer: TrainerView, epoch: int) -> None:
        """After epoch `epoch`."""

    def on_step_start(self, trainer: TrainerView, epoch: int, idx: int) -> None:
        """Before optimizer step `idx` of epoch `epoch` (idx counts steps within the epoch)."""

    def on_step_end(
        self,
        trainer: TrainerView,
        epoch: int,
        idx: int,
        step_metrics: dict[str, Any],
        aggregated_outputs: Any,
    ) -> None:
        """After the step, with its metrics (loss, lr, gnorm, ...)."""

    def on_train_step_start(self, trainer: TrainerView, batches: list[Any]) -> None:
        """Before `train_step` over the step's micro-batches."""

    def on_train_step_end(self, trainer: TrainerView, outputs: list[Any]) -> None:
        """After `train_step`, with each micro-batch's loss."""

    def on_val_step_start(self, trainer: TrainerView, batches: list[Any]) -> None:
        """Before `infer_step` over validation micro-batches."""

    def on_val_step_end(self, trainer: TrainerView, outputs: list[Any]) -> None:
        """After `infer_step`."""

    def after_aggregate_train_step_outputs(
        self, trainer: TrainerView, aggregated_outputs: Any, train_loss: float
    ) -> None:
        """The step's losses were summed across the data-parallel replicas."""

    def after_aggregate_val_step_outputs(
        self, trainer: TrainerView, aggregated_outputs: Any, val_loss: float
    ) -> None:
        """A validation step's losses were summed across the replicas."""

    def before_zero_grad(self, trainer: TrainerView) -> None:
        """Before gradients are cleared."""

    def after_zero_grad(self, trainer: TrainerView) -> None:
        """After gradients are cleared."""

    def before_sync_grad(self, trainer: TrainerView) -> None:
        """Before gradients are scaled for the reduction mode (they are already synchronized)."""

    def after_sync_grad(self, trainer: TrainerView) -> None:
        """After gradients are scaled."""

    def before_gnorm_clip(self, trainer: TrainerView) -> None:
        """Before the gradient norm is computed (and clipped when optimizer.clip_gnorm > 0)."""

    def after_gnorm_clip(self, trainer: TrainerView, gnorm: Any) -> None:
        """After clipping, with the total gradient norm."""

    def before_optimizer_step(self, trainer: TrainerView) -> None:
        """Before `optimizer.step()`."""

    def after_optimizer_step(self, trainer: TrainerView) -> None:
        """After `optimizer.step()`."""

    def before_log_train_metrics(
        self, trainer: TrainerView, step_metrics: dict[str, Any], aggregated_outputs: Any
    ) -> None:
        """Before a step's metrics go to the loggers (edit `step_metrics` in place to add some)."""

    def before_log_val_metrics(self, trainer: TrainerView, metrics: dict[str, Any]) -> None:
        """Before validation metrics go to the loggers."""

    def on_load_checkpoint(self, trainer: TrainerView, checkpoint: dict[str, Any]) -> None:
        """A checkpoint was read, before it is applied (edit it in place to convert it)."""

    def after_load_checkpoint(self, trainer: TrainerView, checkpoint: dict[str, Any]) -> None:
        """A checkpoint was applied."""

    def on_save_checkpoint(self, trainer: TrainerView, checkpoint: dict[str, Any]) -> None:
        """A checkpoint is about to be written (add entries in place to save them too)."""


class AggregatedTrainHook(TrainHook):
    """Calls each of several hooks in turn."""

    def __init__(self, hooks: list[TrainHook]):
        self.hooks = list(hooks)


def _fan_out(name: str) -> Any:
    def call(self: AggregatedTrainHook, *args: Any, **kwargs: Any) -> None:
        for hook in self.hooks:
            getattr(hook, name)(*args, **kwargs)

    call.__name__ = name
    call.__doc__ = getattr(TrainHook, name).__doc__
    return call


for _name in HOOK_NAMES:
    setattr(AggregatedTrainHook, _name, _fan_out(_name))
