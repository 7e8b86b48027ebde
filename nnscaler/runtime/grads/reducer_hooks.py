"""nnScaler's reducer hooks: callables run on each bucket's flat gradient before it is reduced
(`register_pre_hook`) and on its reduced gradient after (`register_post_hook`), mixed into Reducer.

Hooks run once per optimizer step, on the fully accumulated gradient, as under nnScaler 0.8's sync
reducer: a Reducer with hooks defers its reductions to `sync` (the step) instead of launching them in
backward (`ReducerHooksMixin.defers`), and warns once, on rank 0, when that first keeps a reduction from
overlapping backward.

`build_optimizer`'s optimizer registers a hook on every reducer at once
(`optimizer.register_reducer_pre_hook(fn)`, `fn(reducer, grad)`), as nnScaler 0.8's does.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from nnscaler.runtime.grads.grad_ops import average_gradients

__all__ = ["ReducerHooksMixin", "OuterReducer", "GradHook", "add_reducer_hook_methods"]

GradHook = Callable[[torch.Tensor], None]
"""Takes a bucket's flat gradient tensor; may change it in place."""


class ReducerHooksMixin:
    """Pre / post reduction hooks, applied one by one in the order they were registered."""

    last_backward = False
    """Set by `ParallelModule.reducing` (train_step's last micro-batch): the gradient is final in this
    backward, so it launches reductions even when hooks are registered (`defers`)."""
    label = "a ParallelModule's gradient reducer"
    """Names the reducer in warnings (`build_optimizer` sets its module's class and path)."""
    _warned_defer = False

    def register_pre_hook(self, fn: GradHook) -> None:
        """Run `fn(grad)` on each bucket's local (already divided) gradient before it is reduced."""
        if not callable(fn):
            raise TypeError(f"register_pre_hook needs a callable, got {type(fn).__name__}")
        self.__dict__.setdefault("_pre_hooks", []).append(fn)

    def register_post_hook(self, fn: GradHook) -> None:
        """Run `fn(grad)` on each bucket's reduced gradient (this rank's slice under ZeRO) after the
        reduction: once per pre-hook call."""
        if not callable(fn):
            raise TypeError(f"register_post_hook needs a callable, got {type(fn).__name__}")
        self.__dict__.setdefault("_post_hooks", []).append(fn)

    def _apply_pre_hooks(self, grads: torch.Tensor) -> None:
        for fn in self.__dict__.get("_pre_hooks", ()):
            fn(grads)

    def _apply_post_hooks(self, buckets) -> None:
        if not self.__dict__.get("_post_hooks"):
            return
        for bucket in buckets:
            self._run_post_hooks(bucket.owned_grads())

    def _run_post_hooks(self, grads: torch.Tensor) -> None:
        for fn in self.__dict__.get("_post_hooks", ()):
            fn(grads)

    def _has_hooks(self) -> bool:
        return bool(self.__dict__.get("_pre_hooks") or self.__dict__.get("_post_hooks"))

    def defers(self) -> bool:
        """Whether backward leaves every reduction to `sync` (the step): hooks are registered (they run
        once per step, on the gradient accumulated over all of its backward passes) and this backward
        is not known to be the step's last (`last_backward`)."""
        return self._has_hooks() and not self.last_backward

    def _defer(self) -> bool:
        """`defers`, asked for a bucket backward would launch now; the first time it holds, warn (on
        rank 0) that the reductions no longer overlap backward."""
        if not self.defers():
            return False
        if not self._warned_defer:
            self._warned_defer = True
            if not dist.is_initialized() or dist.get_rank() == 0:
                warnings.warn(self._defer_message(), UserWarning, stacklevel=2)
        return True

    def _defer_message(self) -> str:
        stage = getattr(self, "stage", 0)
        memory = ""
        if stage >= 2:
            memory = (
                f" The full gradient buffers are kept until then, so ZeRO stage {stage} saves no "
                "gradient memory in backward."
            )
        return (
            f"{self.label}: reducer hooks are registered, so its gradient reduction no longer overlaps "
            "backward: each bucket is reduced once, at the optimizer step (sync_grad), and the hooks see "
            "the gradient accumulated over all of the step's backward passes (as in nnScaler 0.8)."
            f"{memory} To keep the overlap, register no reducer hooks and accumulate gradients under "
            "module.no_sync() / nnscaler.sync_grad_when(False); train_step still overlaps its last "
            "micro-batch's reductions."
        )


class OuterReducer(ReducerHooksMixin):
    """nnScaler's reducer of the parameters outside every ParallelModule (`build_optimizer` makes one
    when there are such parameters): their gradients averaged over `group` (None: one process, no
    communication), with the hooks around, one flat tensor per dtype."""

    def __init__(self, params: Sequence[torch.nn.Parameter], group: dist.ProcessGroup | None) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.group = group

    @torch.no_grad()
    def reduce(self) -> None:
        if not self._has_hooks():
            average_gradients(self.params, self.group)
            return
        size = dist.get_world_size(self.group) if self.group is not None else 1
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = _flatten_dense_tensors(grads).div_(size)
            self._apply_pre_hooks(flat)
            if self.group is not None:
                dist.all_reduce(flat, group=self.group)
            self._run_post_hooks(flat)
            for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(synced)


def add_reducer_hook_methods(optimizer: torch.optim.Optimizer, reducers: Callable[[], list]) -> None:
    """Give `optimizer` nnScaler's `register_reducer_pre_hook(fn)` / `register_reducer_post_hook(fn)`:
    `fn(reducer, grad)` is registered on every reducer `reducers()` returns (those of the
    ParallelModules the optimizer steps, and its OuterReducer)."""

    def register(kind: str, fn: Callable[[object, torch.Tensor], None]) -> None:
        if not callable(fn):
            raise TypeError(f"register_reducer_{kind}_hook needs a callable, got {type(fn).__name__}")
        for reducer in reducers():
            getattr(reducer, f"register_{kind}_hook")(lambda grad, r=reducer: fn(r, grad))

    optimizer.register_reducer_pre_hook = lambda fn: register("pre", fn)  # type: ignore[attr-defined]
    optimizer.register_reducer_post_hook = lambda fn: register("post", fn)  # type: ignore[attr-defined]
