"""A model holding a ParallelModule cannot be parallelized again (nnScaler 0.8's rule and message)."""

from __future__ import annotations

from torch import nn

from nnscaler.errors import ConfigError
from nnscaler.runtime.module import ParallelModule

__all__ = ["NestedParallelModuleError", "refuse_nested"]


class NestedParallelModuleError(ConfigError, RuntimeError):
    """A ConfigError, and the RuntimeError nnScaler 0.8 raises for it."""


def refuse_nested(module: nn.Module) -> None:
    """Raise NestedParallelModuleError naming the ParallelModules found inside `module`."""
    inner = [name or "<root>" for name, m in module.named_modules() if isinstance(m, ParallelModule)]
    if inner:
        raise NestedParallelModuleError(
            f"Parallel modules can not be nested. {type(module).__name__} already holds parallel "
            f"module(s) at {inner}: parallelize the model's plain submodules instead, or build the "
            "outer model around the parallel modules without parallelizing it again"
        )
