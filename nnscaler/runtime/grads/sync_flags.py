"""nnScaler's `sync_grad_when(cond)`: a scoped switch that keeps backward from launching gradient
reductions (gradient accumulation without naming each module's `no_sync`).

A process-wide counter rather than a context variable: backward hooks run on autograd's device
threads, which do not see the caller's context variables.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["sync_grad_when", "reductions_skipped"]

_lock = threading.Lock()
_skipping = [0]


@contextmanager
def sync_grad_when(cond: bool) -> Iterator[None]:
    """Inside, backward synchronises gradients across data-parallel replicas only when `cond` is True;
    otherwise they accumulate locally until a backward with `cond` True (or `sync_grad` / the optimizer
    step) reduces the sum, as `ParallelModule.no_sync()` does for one module:

        for step in range(accum_steps):
            with nnscaler.sync_grad_when(step == accum_steps - 1):
                model(**batch[step]).backward()
        optimizer.step()
    """
    skip = not cond
    if skip:
        with _lock:
            _skipping[0] += 1
    try:
        yield
    finally:
        if skip:
            with _lock:
                _skipping[0] -= 1


def reductions_skipped() -> bool:
    """Whether some `sync_grad_when(False)` block is open."""
    return _skipping[0] > 0
