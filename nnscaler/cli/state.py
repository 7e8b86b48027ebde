"""What the trainer keeps besides model and optimizer: every random state, and the data position.

`TrainStatus` holds the counters saved in checkpoints; `rng_states()` / `set_rng_states()` cover torch (CPU, CUDA), numpy, random and the runtime's
per-shard generators of tensor-parallel dropout; `SkippingSampler` starts the next epoch pass some
samples in (resuming mid-epoch); `to_device` moves a batch and casts its floating tensors.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

from nnscaler.runtime import rng as _shard_rng  # its shard generators are part of the random state

__all__ = ["TrainStatus", "rng_states", "set_rng_states", "SkippingSampler", "to_device"]


@dataclass
class TrainStatus:
    """Counters saved in checkpoints, read as attributes (nnScaler 0.8's `finished_train_steps`,
    `best_loss`) or as dict keys (`status["step"]`, `dict(status)`, `status.update(saved)`).

    The keys are the four fields, and any other key set on it (as on a dict: a checkpoint written
    with another key resumes and saves it again), so a checkpoint holds `dict(status)` as before.
    Not a dict subclass: the fields are the one copy of each counter, typed attributes that hooks read.
    """

    next_epoch: int = 0
    """The epoch the next training step is in."""
    next_sample: int = 0
    """Samples of that epoch already consumed by all replicas together (a resume with another
    replica count starts at the same place)."""
    step: int = 0
    """Optimizer steps done."""
    best_loss: float = math.inf
    """The lowest loss a checkpoint was saved at (the `best` checkpoint's)."""
    _extra: dict[str, Any] = field(default_factory=dict, repr=False)
    """Other keys set on it (dict semantics)."""

    _ALIASES = {"finished_train_steps": "step"}  # nnScaler 0.8's name -> ours (checkpoints it wrote)

    @property
    def finished_train_steps(self) -> int:
        """Optimizer steps done (nnScaler 0.8's name for `step`)."""
        return self.step

    @finished_train_steps.setter
    def finished_train_steps(self, value: int) -> None:
        self.step = value

    # ---- the dict view --------------------------------------------------------------------------

    def _field(self, key: str) -> str | None:
        """The field `key` names (nnScaler 0.8's names included), or None (an extra key)."""
        key = self._ALIASES.get(key, key)
        return key if key in _FIELDS else None

    def keys(self) -> list[str]:
        return [*_FIELDS, *self._extra]

    def __getitem__(self, key: str) -> Any:
        name = self._field(key)
        return getattr(self, name) if name else self._extra[key]

    def __setitem__(self, key: str, value: Any) -> None:
        name = self._field(key)
        if name:
            setattr(self, name, value)
        else:
            self._extra[key] = value

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and (self._field(key) is not None or key in self._extra)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(_FIELDS) + len(self._extra)

    def __eq__(self, other: object) -> bool:  # equal to a dict with the same keys and values too
        if isinstance(other, (TrainStatus, Mapping)):
            return dict(self.items()) == dict(other.items())
        return NotImplemented

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def values(self) -> list[Any]:
        return [self[k] for k in self.keys()]

    def items(self) -> list[tuple[str, Any]]:
        return [(k, self[k]) for k in self.keys()]

    def update(self, other: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        """Set the given keys (a checkpoint's `train_status`; nnScaler 0.8's `finished_train_steps`
        sets `step`)."""
        for key, value in {**dict(other or {}), **kwargs}.items():
            self[key] = value

    def clear(self) -> None:
        """Back to the start of training: the fields at their initial values, no extra keys."""
        for f in fields(self):
            if f.name in _FIELDS:
                setattr(self, f.name, f.default)
        self._extra.clear()


_FIELDS = ("next_epoch", "next_sample", "step", "best_loss")
"""TrainStatus's keys that are fields (in checkpoint order)."""


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
