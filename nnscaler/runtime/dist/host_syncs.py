"""Count host syncs (reads of tensor values on the host) in a block of code, on any device.

    with count_host_syncs() as syncs:
        loss = model.train_step(batch)
    print(syncs.count, syncs.sites)

On CUDA each of these makes the CPU wait for the GPU; on CPU they cost nothing, so a CPU run counts
them by patching the Tensor methods that read values on the host: `item`, `tolist`, `__bool__`,
`__float__`, `__int__`, `__index__`, `cpu` and `numpy`. Every call is counted, whatever the tensor's
device, except reads made inside torch.optim: its non-capturable optimizers read their `step`
counters, which live on the CPU even under CUDA (not a GPU sync); those are counted apart in
`HostSyncs.torch_optim`. On CUDA, `torch.cuda.set_sync_debug_mode("warn")` is the real check.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["HostSyncs", "count_host_syncs", "host_only", "SYNC_METHODS"]

SYNC_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")
"""The torch.Tensor methods counted as host syncs."""

_TORCH_DIR = os.path.dirname(torch.__file__)
_OPTIM_DIR = os.path.join(_TORCH_DIR, "optim")


@dataclass
class HostSyncs:
    """What `count_host_syncs` saw: the number of calls and where they came from."""

    count: int = 0
    sites: collections.Counter[str] = field(default_factory=collections.Counter)
    """'method file:line' of the first caller outside torch -> calls."""
    torch_optim: int = 0
    """Reads made by torch.optim itself (its CPU `step` counters), not in `count`."""
    host_only: int = 0
    """Reads of tensors that live on the host under CUDA too (inside `host_only()`), not in `count`."""


_HOST_ONLY = threading.local()


@contextlib.contextmanager
def host_only() -> Iterator[None]:
    """Mark reads inside the block as reads of CPU tensors (e.g. a check exchanged over a gloo group):
    no device sync on any device, so `count_host_syncs` counts them apart."""
    depth = getattr(_HOST_ONLY, "depth", 0)
    _HOST_ONLY.depth = depth + 1
    try:
        yield
    finally:
        _HOST_ONLY.depth = depth


def _site(method: str) -> str:
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH_DIR):
        frame = frame.f_back
    if frame is None:
        return f"{method} <torch>"
    return f"{method} {os.path.relpath(frame.f_code.co_filename)}:{frame.f_lineno}"


def _counting(method: str, original: Callable[..., Any], syncs: HostSyncs) -> Callable[..., Any]:
    def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if sys._getframe(1).f_code.co_filename.startswith(_OPTIM_DIR):
            syncs.torch_optim += 1
        elif getattr(_HOST_ONLY, "depth", 0):
            syncs.host_only += 1
        else:
            syncs.count += 1
            syncs.sites[_site(method)] += 1
        return original(self, *args, **kwargs)

    wrapper.__name__ = method
    return wrapper


@contextlib.contextmanager
def count_host_syncs() -> Iterator[HostSyncs]:
    """Count calls of `SYNC_METHODS` on tensors inside the block (not thread-safe; not nestable)."""
    syncs = HostSyncs()
    originals = {m: torch.Tensor.__dict__.get(m) for m in SYNC_METHODS}
    for m in SYNC_METHODS:
        setattr(torch.Tensor, m, _counting(m, getattr(torch.Tensor, m), syncs))
    try:
        yield syncs
    finally:
        for m, original in originals.items():
            if original is None:
                delattr(torch.Tensor, m)  # inherited from torch._C.TensorBase again
            else:
                setattr(torch.Tensor, m, original)
