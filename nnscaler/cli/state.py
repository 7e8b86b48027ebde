"""What the trainer keeps besides model and optimizer: every random state, and the data position.

`rng_states()` / `set_rng_states()` cover torch (CPU, CUDA), numpy, random and the runtime's
per-shard generators of tensor-parallel dropout; `SkippingSampler` starts the next epoch pass some
samples in (resuming mid-epoch); `to_device` moves a batch and casts its floating tensors.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from nnscaler.runtime import rng as _shard_rng  # its shard generators are part of the random state

__all__ = ["rng_states", "set_rng_states", "SkippingSampler", "to_device"]


def to_device(value: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    if isinstance(value, dict):
        return {k: to_device(v, device, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device, dtype) for v in value)
    if isinstance(value, torch.Tensor):
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        return value.to(device)
    return value


class SkippingSampler(torch.utils.data.Sampler):
    """Wraps a sampler so that the next iteration starts `skip` indices in (resuming mid-epoch)."""

    def __init__(self, sampler: Any):
        self.sampler, self.skip = sampler, 0

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self):
        skip, self.skip = self.skip, 0
        it = iter(self.sampler)
        for _ in range(skip):
            next(it, None)
        return it

    def __len__(self) -> int:
        return len(self.sampler)


def rng_states() -> dict[str, Any]:
    """Every random generator a training step draws from: torch (CPU, CUDA), numpy, random, and the
    runtime's per-shard generators of tensor-parallel dropout."""
    states = {"torch": torch.get_rng_state(), "numpy": _numpy_state(), "random": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    states["shard"] = _shard_rng.shard_rng_states()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    np.random.set_state(_numpy_state_tuple(states["numpy"]))
    random.setstate(states["random"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
    _shard_rng.set_shard_rng_states(states.get("shard", {}))


def _numpy_state() -> dict[str, Any]:
    """numpy's global generator state as tensors and numbers, so that a checkpoint holding it loads
    with `torch.load(..., weights_only=True)` (torch's default; a numpy array would be refused)."""
    key, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "key": str(key),
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }


def _numpy_state_tuple(state: Any) -> tuple:
    """The tuple `np.random.set_state` takes, from `_numpy_state()`'s dict or (older checkpoints)
    numpy's own tuple."""
    if not isinstance(state, dict):
        return state
    keys = state["keys"].numpy().astype(np.uint32)
    return (state["key"], keys, state["pos"], state["has_gauss"], state["cached_gaussian"])
