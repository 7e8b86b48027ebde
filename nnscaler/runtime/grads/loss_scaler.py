"""Dynamic loss scaling for fp16 training with the mixed-precision optimizers (mixed_precision.py),
and the world-wide inf / nan check that decides whether a step is skipped."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from nnscaler.runtime.device import is_initialized, runtime_device


class LossScaledOptimizer(Protocol):
    """An optimizer that unscales its gradients by `loss_scaler` (MixedPrecisionAdam / AdamW, which
    import this module; they set the class attribute `takes_loss_scaler`)."""

    loss_scaler: DynamicLossScaler | None


def _loss_scaled(optimizer: Any) -> LossScaledOptimizer | None:
    """`optimizer` if it takes a loss scaler, or the one a ZeroOptimizer wraps; else None."""
    for opt in (optimizer, getattr(optimizer, "inner", None)):
        if getattr(type(opt), "takes_loss_scaler", False) is True:
            return opt
    return None


__all__ = ["DynamicLossScaler", "any_nonfinite"]


def _world() -> dist.ProcessGroup | None:
    return dist.group.WORLD if is_initialized() and dist.get_world_size() > 1 else None


def any_nonfinite(grads: Iterable[torch.Tensor]) -> bool:
    """Whether any of `grads` holds inf or nan on any rank of the world (collective over the world)."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for g in grads:
        if g.numel():
            groups.setdefault((g.dtype, g.device), []).append(g.detach())
    flag = torch.zeros((), dtype=torch.float32, device=runtime_device())
    for gs in groups.values():
        peak = torch.stack([n.float() for n in torch._foreach_norm(gs, math.inf)]).sum()
        flag = torch.maximum(flag, (~torch.isfinite(peak)).float().to(flag.device))
    world = _world()
    if world is not None:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=world)
    return bool(flag.item())  # the step's one host sync: whether to skip it is decided on the host


class DynamicLossScaler:
    """Dynamic loss scaling for fp16 training with the mixed-precision optimizers.

    The loss is multiplied by `get_scale()` before backward; the optimizer divides the gradients by it
    again when it casts them to fp32. A step whose gradients hold inf or nan on any rank is skipped
    on every rank and the scale is multiplied by `backoff_factor`; after `growth_interval` steps in a
    row without, it is multiplied by `growth_factor`. Use it like `torch.amp.GradScaler`:

        loss = scaler.scale(loss); loss.backward(); scaler.step(opt); scaler.update()

    or give it to the optimizer (`loss_scaler=scaler`) and call `opt.step()`. Either way the step
    updates the scale; `update()` only sets a scale given explicitly.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        for name, value, ok in [
            ("init_scale", init_scale, init_scale > 0),
            ("growth_factor", growth_factor, growth_factor > 1),
            ("backoff_factor", backoff_factor, 0 < backoff_factor < 1),
            ("growth_interval", growth_interval, isinstance(growth_interval, int) and growth_interval >= 1),
        ]:
            if not ok:
                raise ValueError(f"DynamicLossScaler: bad {name}={value!r}")
        self._scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self._good_steps = 0
        """Steps without inf / nan since the scale last changed."""
        self.found_inf = False
        """Whether the last step found inf / nan gradients (and was skipped)."""
        self.skipped_steps = 0

    def get_scale(self) -> float:
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss * scale`, to call backward on."""
        return loss * self._scale

    def _attach(self, optimizer: torch.optim.Optimizer) -> LossScaledOptimizer:
        mp = _loss_scaled(optimizer)
        if mp is None:
            raise TypeError(
                f"DynamicLossScaler works with MixedPrecisionAdam / MixedPrecisionAdamW (also under ZeRO), "
                f"not {type(optimizer).__name__}"
            )
        if mp.loss_scaler is None:
            mp.loss_scaler = self
        elif mp.loss_scaler is not self:
            raise ValueError("the optimizer already has another DynamicLossScaler")
        return mp

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Attach to `optimizer`; the gradients are unscaled when they are cast to fp32 (so this copies
        nothing), and `optimizer.clip_gnorm` reports and clips the unscaled norm."""
        self._attach(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """`optimizer.step()`, skipped (on all ranks) when some gradient is inf / nan; updates the scale."""
        self._attach(optimizer)
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | None = None) -> None:
        """Set the scale to `new_scale` if given (the step already updated it otherwise)."""
        if new_scale is not None:
            if not new_scale > 0:
                raise ValueError(f"DynamicLossScaler.update: bad new_scale={new_scale!r}")
            self._scale, self._good_steps = float(new_scale), 0

    def _observe(self, found_inf: bool) -> None:
        """Record a step's verdict (the same on every rank) and move the scale."""
        self.found_inf = found_inf
        if found_inf:
            self._scale *= self.backoff_factor
            self._good_steps = 0
            self.skipped_steps += 1
            return
        self._good_steps += 1
        if self._good_steps >= self.growth_interval:
            self._scale *= self.growth_factor
            self._good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self._scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "good_steps": self._good_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scale = float(state["scale"])
        self.growth_factor = float(state.get("growth_factor", self.growth_factor))
        self.backoff_factor = float(state.get("backoff_factor", self.backoff_factor))
        self.growth_interval = int(state.get("growth_interval", self.growth_interval))
        self._good_steps = int(state.get("good_steps", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
