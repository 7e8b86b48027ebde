"""A pipelined parallel module (`ComputeConfig(use_end2end=True)`) called like a plain module in a
Fabric loop: `loss = model(**batch)` runs the whole schedule.

In training (grad enabled, `model.train()`) the call splits the batch into the schedule's
micro-batches, runs their forwards and backwards (`ParallelModule.train_step`, each micro-batch's loss
scaled by 1 / micro-batches, so the gradients are those of the batch's mean loss), averages the
gradients over the data-parallel replicas and returns the forward's outputs made one
(`combine_micro_outputs`): the loss is their mean, a leaf that requires grad, on every rank.
`fabric.backward(loss)` on that loss is then a no-op (the strategy checks it is that loss). In
evaluation the call runs the forward schedule only (`infer_step`).

Gradients are zeroed before the first call after an optimizer step (not by `optimizer.zero_grad()`,
which the strategy makes a no-op): calls before one step add their gradients up.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from nnscaler.integration.lightning.outputs import combine_micro_outputs
from nnscaler.runtime.module import ParallelModule

__all__ = ["PipelinedCall"]


class PipelinedCall(nn.Module):
    """`forward(*args, **kwargs)` with the user's forward signature runs a step of `pm`'s schedule;
    its state dict is `pm`'s (the same names, so checkpoints merge as without a pipeline)."""

    def __init__(self, pm: ParallelModule, signature: inspect.Signature) -> None:
        super().__init__()
        self.pm = pm
        self._signature = signature
        self.grads_stale = True
        self.last_loss: torch.Tensor | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        sample = dict(self._signature.bind(*args, **kwargs).arguments)
        pm = self.pm
        if not (torch.is_grad_enabled() and self.training):
            return combine_micro_outputs(pm.infer_step(sample, return_outputs=True), train=False)
        if self.grads_stale:
            pm.zero_grad()
            self.grads_stale = False
        n = pm.nmicros_per_scheduler_step
        outputs = pm.train_step(sample, scale_fn=lambda loss: loss / n, return_outputs=True)
        out = combine_micro_outputs(outputs, train=True)  # backward done above
        self.last_loss = pytree.tree_leaves(out)[0]  # the loss (combine_micro_outputs' first leaf)
        return out

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.pm.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.pm.load_state_dict(state_dict, strict=strict, assign=assign)
