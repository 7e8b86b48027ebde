"""What Zeno needs from a ParallelModule (grad_aggregation='zeno', runtime/grads/zeno.py): the
validation loss (a forward pass in eval mode, without grad) and the squared norm of one replica's
gradient (each tensor-parallel piece counted once, summed over the plan's ranks).

The validation micro-batch is, in order: the user's (`set_zeno_scorer(fn)` / `set_zeno_batch(batch)`),
else train_step's last micro-batch of the step (which is also trained on: it is a slice of the step's
batch held for scoring, not held out of training). A plain backward + optimizer step without either
cannot be scored, and the step refuses with a ConfigError saying so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

__all__ = ["attach", "batch_scorer", "batch_loss"]


def batch_loss(module: Any, batch: Any) -> torch.Tensor:
    """The module's loss on `batch` (forward arguments as train_step takes a micro-batch): the first
    tensor the forward returns."""
    from nnscaler.runtime.pipeline import forward_kwargs

    args = module.forward_args
    kwargs = forward_kwargs(batch, args) if args else dict(batch)
    out = module(**kwargs)
    for leaf in tree_leaves(out):
        if isinstance(leaf, torch.Tensor):
            return leaf
    raise TypeError(f"{type(module).__name__}.forward returned no tensor to use as the Zeno validation loss")


def batch_scorer(batch: Any) -> Callable[[Any], torch.Tensor]:
    """A scorer (module -> loss) on a fixed validation micro-batch."""
    return lambda module: batch_loss(module, batch)


def _loss_fn(module: Any) -> Callable[[], torch.Tensor] | None:
    scorer = module._zeno_scorer
    if scorer is None and module._zeno_step_batch is not None:
        scorer = batch_scorer(module._zeno_step_batch)
    if scorer is None:
        return None

    def loss() -> torch.Tensor:
        was = module.training
        module.eval()  # no dropout noise, no batch-norm statistics updated by scoring
        try:
            with torch.no_grad():
                return scorer(module)
        finally:
            module.train(was)

    return loss


def _sq_norm_fn(module: Any) -> Callable[[Sequence[tuple[torch.nn.Parameter, torch.Tensor]]], torch.Tensor]:
    def sq_norm(grads: Sequence[tuple[torch.nn.Parameter, torch.Tensor]]) -> torch.Tensor:
        owned = {id(p) for p, own in zip(module._norm_params(), module._owned_params()) if own}
        total = torch.zeros((), dtype=torch.float32, device=grads[0][1].device if grads else None)
        for p, g in grads:
            if id(p) in owned:
                total = total + g.float().square().sum()
        plan = module.group("plan")
        if plan is not None:
            dist.all_reduce(total, group=plan)
        return total

    return sq_norm


def attach(module: Any, reducer: Any) -> None:
    """Before the reducer's sync: hand its Zeno (if any) the module's validation loss and gradient norm."""
    zeno = reducer.robust.zeno if reducer.robust is not None else None
    if zeno is not None:
        zeno.loss_fn = _loss_fn(module)
        zeno.sq_norm_fn = _sq_norm_fn(module)
