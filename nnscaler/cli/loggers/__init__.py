"""Trainer loggers; `log: [{type: TensorBoardLogger, args: {...}}]` names them by class."""

from nnscaler.cli.loggers.logger_base import LoggerBase
from nnscaler.cli.loggers.tensorboard import TensorBoardLogger
from nnscaler.cli.loggers.wandb import WandbLogger

__all__ = ["LoggerBase", "TensorBoardLogger", "WandbLogger"]
