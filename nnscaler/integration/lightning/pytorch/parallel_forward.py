"""`self(...)` of a LightningModule that NnScalerStrategy parallelized: its parallel module's forward.

Installed as the module's instance `forward`. An object holding the LightningModule, not a closure
over the parallel module: `copy.deepcopy` or `pickle` of the LightningModule (an EMA or teacher copy,
Lightning's WeightAveraging callback) carry the reference along, so the copy runs its own
`nnscaler_module` (module_parts/copies.py), not the original's. The strategy (whose flag says when a
pipeline's gradients are due to be zeroed) is shared by a deep copy and dropped by pickle.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch

from nnscaler.integration.lightning.outputs import combine_micro_outputs

__all__ = ["ParallelForward"]


class ParallelForward:
    """Calls `module.nnscaler_module`; under a pipeline (`pipelined`) training runs the whole schedule
    (forward and backward) over the batch's micro-batches, evaluation the forward schedule."""

    def __init__(self, strategy: Any, module: torch.nn.Module, pipelined: bool):
        self.strategy = strategy
        self.module = module
        self.pipelined = pipelined

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        pm = self.module.nnscaler_module
        if not self.pipelined:
            return pm(*args, **kwargs)
        signature = inspect.signature(type(self.module).forward.__get__(self.module))
        sample = dict(signature.bind(*args, **kwargs).arguments)
        if torch.is_grad_enabled() and self.module.training:
            if self.strategy is None:
                raise RuntimeError(
                    f"{type(self.module).__name__} was unpickled without its NnScalerStrategy: pipelined "
                    "training needs it (it zeroes the gradients between optimizer steps); train it under a "
                    "Trainer with the strategy, or call it for evaluation (torch.no_grad() or .eval())"
                )
            if self.strategy._grads_stale:
                pm.zero_grad()
                self.strategy._grads_stale = False
            n = pm.nmicros_per_scheduler_step
            outputs = pm.train_step(sample, scale_fn=lambda loss: loss / n, return_outputs=True)
            return combine_micro_outputs(outputs, train=True)  # backward done above
        return combine_micro_outputs(pm.infer_step(sample, return_outputs=True), train=False)

    def __deepcopy__(self, memo: dict[int, Any]) -> ParallelForward:
        return ParallelForward(self.strategy, copy.deepcopy(self.module, memo), self.pipelined)

    def __getstate__(self) -> dict[str, Any]:
        return {"strategy": None, "module": self.module, "pipelined": self.pipelined}
