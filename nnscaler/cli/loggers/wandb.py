"""Weights & Biases (needs the `wandb` package; `mode: offline` works without an account)."""

from __future__ import annotations

from typing import Any

from nnscaler.cli.loggers.logger_base import LoggerBase
from nnscaler.errors import ConfigError

__all__ = ["WandbLogger"]


class WandbLogger(LoggerBase):
    """`wandb.init(project=..., name=..., dir=..., mode=...)` with the run's config."""

    def __init__(
        self, project: str | None = None, name: str | None = None, dir: str | None = None, **kwargs: Any
    ):
        self.init_args = {"project": project, "name": name, "dir": dir, **kwargs}
        self.run: Any = None

    def setup(self, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ConfigError("log: WandbLogger needs the wandb package (pip install wandb)") from err
        self.run = wandb.init(config=config, **{k: v for k, v in self.init_args.items() if v is not None})

    def log_metrics(self, metrics: dict[str, float], step: int, *, tag: str | None = None) -> None:
        self.run.log({f"{tag}/{k}" if tag else k: v for k, v in metrics.items()}, step=step)

    def finalize(self) -> None:
        """Finish the run; its files are complete on return (wandb's service writes them after
        `finish` returns: it is torn down here unless another run of this process is still active)."""
        if self.run is not None:
            import wandb

            self.run.finish()
            self.run = None
            if getattr(wandb, "run", None) is None and hasattr(wandb, "teardown"):
                wandb.teardown()
