"""`copy.deepcopy` and `pickle` of a ParallelModule (an EMA, teacher or reference copy).

A copy holds copies of this rank's parameters and buffers, and computes with them: its compiled
methods compile again for it (module_parts/compiled.py), its opaque leaves run its own tensors
(runtime/leaf.py). What is not copied is the gradient reducer: its buckets view this module's
gradients and its hooks sit on this module's parameters, so a copy that shared or cloned it would
sync the wrong gradients; the copy builds its own on its first backward, over the same process groups
(every rank of the plan must then run the copy too, as with the original). Under ZeRO stage 3 the
reducer holds the parameters themselves (sharded), so a copy is refused once it is built.
"""

from __future__ import annotations

import copy
from typing import Any

from nnscaler.runtime.dist import lifecycle

__all__ = ["CopiesMixin"]

_PER_INSTANCE = {"_reducer": None, "_reducer_built": False, "_zero3": None}
"""Attributes a copy starts afresh (its own reducer is built on first use)."""


class CopiesMixin:
    """deepcopy / pickle for ParallelModule: everything but the gradient reducer (module docstring)."""

    def _refuse_copy(self, how: str) -> None:
        if self.__dict__.get("_zero3") is not None:
            raise RuntimeError(
                f"{type(self).__name__} cannot be copied with {how}: under ZeRO stage 3 its parameters are "
                "sharded inside its gradient reducer, which belongs to this module. Build the copy from the "
                "state instead: `other = type(module)(init_params=False); "
                "other.load_state_dict(module.state_dict())` (on every rank), or copy the model before "
                "the first forward"
            )

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        self._refuse_copy("copy.deepcopy")
        cls = type(self)
        new = cls.__new__(cls)
        memo[id(self)] = new  # references back to this module (compiled methods) go to the copy
        state = {k: v for k, v in self.__dict__.items() if k not in _PER_INSTANCE}
        new.__dict__.update(copy.deepcopy(state, memo))
        new.__dict__.update(_PER_INSTANCE)
        lifecycle.track(new)
        return new

    def __getstate__(self) -> dict[str, Any]:
        self._refuse_copy("pickle")
        return {**self.__dict__, **_PER_INSTANCE}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[misc]
        lifecycle.track(self)
