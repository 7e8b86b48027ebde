"""TensorBoard event files (needs the `tensorboard` package: pip install nnscaler[tensorboard])."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nnscaler.cli.loggers.logger_base import LoggerBase
from nnscaler.errors import ConfigError

__all__ = ["TensorBoardLogger"]


class TensorBoardLogger(LoggerBase):
    """Writes scalars under `root_dir/name` (name defaults to 'run')."""

    def __init__(self, root_dir: str = "./tensorboard", name: str | None = None, **kwargs: Any):
        self.log_dir = Path(root_dir) / (name or "run")
        self.kwargs = kwargs
        self.writer: Any = None

    def setup(self, config: dict[str, Any]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ConfigError(
                "log: TensorBoardLogger needs the tensorboard package (pip install tensorboard)"
            ) from err
        self.writer = SummaryWriter(log_dir=str(self.log_dir), **self.kwargs)

    def log_metrics(self, metrics: dict[str, float], step: int, *, tag: str | None = None) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(f"{tag}/{key}" if tag else key, value, step)

    def finalize(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None
