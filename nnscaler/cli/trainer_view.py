"""`TrainerView`: what hooks, `TrainerArgs.init_env` and the checkpoint code see of a running
`Trainer`. A Protocol in a leaf module, so that they name the trainer's type without importing
nnscaler.cli.trainer, which imports them."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["TrainerView"]


@runtime_checkable
class TrainerView(Protocol):
    """The public state of a `nnscaler.cli.trainer.Trainer` (which satisfies this Protocol)."""

    train_args: Any
    """The run's TrainerArgs."""
    model: Any
    """The parallelized model (a ParallelModule, or a module holding parallel sub-modules)."""
    optimizer: Any
    lr_scheduler: Any
    loggers: list[Any]
    """The loggers (rank 0 only; empty elsewhere)."""
    hook: Any
    """The run's TrainHook."""
    train_status: Any
    """A `nnscaler.cli.state.TrainStatus`: next_epoch, next_sample, step, best_loss (saved in
    checkpoints), as attributes or dict keys; `finished_train_steps` is nnScaler 0.8's name for step."""
    rank: int
    world_size: int
    pending_rng: dict[str, Any] | None
    """Random states to restore when the next epoch's data iterator starts (set by a resume)."""
    last_val_loss: float | None
    losses: list[float]
    """The aggregated loss of each optimizer step of this run."""

    def log_metrics(
        self, metrics: dict[str, float], step: int | None = None, *, tag: str | None = None
    ) -> None: ...
