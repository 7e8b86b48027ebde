"""The CLI trainer: `TrainerArgs` (YAML + command-line overrides) and `Trainer` (nnScaler's names).

python -m nnscaler.cli.train -f cfg.yaml --compute_config.plan_ngpus 2
torchrun --nproc_per_node 4 -m nnscaler.cli.train -f cfg.yaml
"""

from nnscaler.cli.aggregate import AggregatedOutputs
from nnscaler.cli.configs import (
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
)
from nnscaler.cli.loggers import LoggerBase, TensorBoardLogger, WandbLogger
from nnscaler.cli.train_hook import AggregatedTrainHook, TrainHook
from nnscaler.cli.trainer import Trainer
from nnscaler.cli.trainer_args import TrainerArgs

__all__ = [
    "Trainer",
    "TrainerArgs",
    "TrainHook",
    "AggregatedOutputs",
    "AggregatedTrainHook",
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
    "LoggerBase",
    "TensorBoardLogger",
    "WandbLogger",
]
