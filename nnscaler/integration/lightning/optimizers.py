"""The user's optimizer (from `configure_optimizers` or given to Fabric) made to drive a parallel module.

Without ZeRO the optimizer already holds the parallel module's parameters and is attached as it is
(`attach_optimizer`: gradient sync before the step, names in its state dict, `clip_gnorm`). Under
ZeRO (`ComputeConfig.use_zero`, stages 1-3) it is handed to `build_optimizer`, which gives it this
rank's slices of the parameters in place of its one param group (as nnScaler 0.8's Lightning
strategy does): the optimizer object, its hyper-parameters and any LR scheduler bound to it stay
the user's, and the returned `ZeroOptimizer` steps it on the slices. Fabric's optimizer, built over
the model before it was parallelized, has its one param group replaced the same way, ZeRO or not."""

from __future__ import annotations

from typing import Any

import torch

from nnscaler.errors import ConfigError
from nnscaler.runtime.optimizer import attach_optimizer, build_optimizer

__all__ = ["nnscaler_optimizer"]


def nnscaler_optimizer(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, who: str, rebind: bool = False
) -> torch.optim.Optimizer:
    """`optimizer` set up for the parallel `module` (ZeRO or not, see the module docstring); `who`
    names the caller in errors. `rebind`: the optimizer was built over the module before it was
    parallelized (Fabric): its one param group gets the parallel module's parameters, ZeRO or not."""
    config = getattr(module, "compute_config", None)
    zero = config is not None and config.use_zero
    if not zero and not rebind:
        return attach_optimizer(module, optimizer)
    why = "under ZeRO (ComputeConfig.use_zero)" if zero else "given before the model was parallelized"
    if len(optimizer.param_groups) != 1:
        raise ConfigError(
            f"{who}: an optimizer {why} must have one param group (its parameters are replaced by the parallel "
            f"module's), {type(optimizer).__name__} has {len(optimizer.param_groups)}: put every parameter in one group"
        )
    if optimizer.state:
        raise ConfigError(
            f"{who}: an optimizer {why} must not have taken a step yet (its state is not empty)"
        )

    def in_place(params: list[Any], **_: Any) -> torch.optim.Optimizer:
        optimizer.param_groups[0]["params"] = list(params)  # this rank's slices (ZeroOptimizer's pieces)
        return optimizer

    return build_optimizer(module, in_place)
