"""NnScalerPrecision: Lightning's precision modes for a parallelized module. What differs from
Lightning's own plugins: gradient clipping takes the norm over every shard of every parameter (a
tensor-parallel weight's pieces live on several ranks), and fp16 loss scaling skips a step on every
rank when any rank saw inf or nan (otherwise the ranks' weights would drift apart)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

__all__ = ["NnScalerPrecision", "PRECISIONS"]

PRECISIONS = ("32-true", "16-true", "bf16-true", "16-mixed", "bf16-mixed")


class _ShardedClip:
    """Clip by the norm of all shards (runtime.optimizer's clip_gnorm on attached optimizers)."""

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        clip = getattr(optimizer, "clip_gnorm", None)
        if clip is None:
            raise RuntimeError(
                "NnScalerPrecision: the optimizer was not set up by NnScalerStrategy (no clip_gnorm); "
                "train with strategy=NnScalerStrategy(...)"
            )
        clip(float(clip_val))


class _Full(_ShardedClip, Precision):
    pass


class _Half(_ShardedClip, HalfPrecision):
    pass


class _Mixed(_ShardedClip, MixedPrecision):
    def _after_closure(self, model: Any, optimizer: Any) -> None:
        if self.scaler is not None and dist.is_initialized() and dist.get_world_size() > 1:
            # GradScaler decides per rank whether to skip the step; make it one decision for all
            state = self.scaler._per_optimizer_states[id(optimizer)]  # filled by unscale_
            for found in state["found_inf_per_device"].values():
                dist.all_reduce(found, op=dist.ReduceOp.MAX)
        super()._after_closure(model, optimizer)


class NnScalerPrecision(Precision):
    """`precision`: '32-true', '16-true', 'bf16-true' (weights and math in that dtype), '16-mixed',
    'bf16-mixed' (fp32 weights, autocast; fp16 with a GradScaler, or `scaler`)."""

    def __init__(self, precision: str = "32-true", scaler: Any = None) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"NnScalerPrecision(precision={precision!r}): use one of {list(PRECISIONS)}")
        if scaler is not None and precision != "16-mixed":
            raise ValueError(f"NnScalerPrecision: a scaler is only used with '16-mixed', not {precision!r}")
        self.precision = precision  # type: ignore[assignment]
        if precision == "32-true":
            self._inner: Precision = _Full()
        elif precision.endswith("-true"):
            self._inner = _Half(precision)  # type: ignore[arg-type]
        else:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            self._inner = _Mixed(precision, device, scaler)  # type: ignore[arg-type]

    @property
    def scaler(self) -> Any:
        return getattr(self._inner, "scaler", None)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return self._inner.convert_module(module)

    def tensor_init_context(self) -> AbstractContextManager:
        return self._inner.tensor_init_context()

    def module_init_context(self) -> AbstractContextManager:
        return self._inner.module_init_context()

    def forward_context(self) -> AbstractContextManager:
        return self._inner.forward_context()

    def convert_input(self, data: Any) -> Any:
        return self._inner.convert_input(data)

    def convert_output(self, data: Any) -> Any:
        return self._inner.convert_output(data)

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        return self._inner.pre_backward(tensor, module)

    def backward(self, tensor, model, optimizer, *args: Any, **kwargs: Any) -> None:
        self._inner.backward(tensor, model, optimizer, *args, **kwargs)

    def post_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        return self._inner.post_backward(tensor, module)

    def optimizer_step(self, optimizer, model, closure, **kwargs: Any) -> Any:
        return self._inner.optimizer_step(optimizer, model, closure, **kwargs)

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=None) -> None:
        if gradient_clip_algorithm is None:
            self._inner.clip_gradients(optimizer, clip_val)
        else:
            self._inner.clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    def state_dict(self) -> dict[str, Any]:
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._inner.load_state_dict(state_dict)

    def teardown(self) -> None:
        self._inner.teardown()
