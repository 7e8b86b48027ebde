"""TensorBoard event files (needs the `tensorboard` package: pip install nnscaler[tensorboard])."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from nnscaler.cli.loggers.logger_base import LoggerBase
from nnscaler.errors import ConfigError

__all__ = ["TensorBoardLogger"]


class TensorBoardLogger(LoggerBase):
    """Writes scalars under `root_dir/name` (name defaults to 'run'), one event file per tag as in
    nnScaler 0.8: `train/loss` is scalar `loss` in `root_dir/name/train`, `val/loss` scalar `loss`
    in `.../val` (TensorBoard draws them as two runs on one chart); a name without `/` goes to
    `root_dir/name` itself."""

    def __init__(self, root_dir: str = "./tensorboard", name: str | None = None, **kwargs: Any):
        self.log_dir = Path(root_dir) / (name or "run")
        self.kwargs = kwargs
        self.writers: dict[str, Any] = {}
        self._writer_type: Any = None
        self._config = ""

    def setup(self, config: dict[str, Any]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ConfigError(
                "log: TensorBoardLogger needs the tensorboard package (pip install tensorboard)"
            ) from err
        self._writer_type = SummaryWriter
        try:
            self._config = yaml.safe_dump(config, sort_keys=False)
        except yaml.YAMLError:  # a value yaml cannot write: its repr
            self._config = repr(config)

    def _writer(self, tag: str) -> Any:
        if tag not in self.writers:
            self.writers[tag] = self._writer_type(log_dir=str(self.log_dir / tag), **self.kwargs)
            self.writers[tag].add_text("config", f"```yaml\n{self._config}```")  # the run's TrainerArgs
        return self.writers[tag]

    def log_metrics(self, metrics: dict[str, float], step: int, *, tag: str | None = None) -> None:
        for key, value in metrics.items():
            full = f"{tag}/{key}" if tag else key
            run, _, name = full.rpartition("/")
            self._writer(run).add_scalar(name, value, step)

    def finalize(self) -> None:
        for writer in self.writers.values():
            writer.flush()
            writer.close()
        self.writers = {}
