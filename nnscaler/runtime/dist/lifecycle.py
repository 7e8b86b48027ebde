"""Orderly teardown at the end of a run. A process that exits with a gloo process group still up,
or with gradient buckets that async collectives wrote into still alive, can abort in C++ while the
interpreter shuts down ("terminate called without an active exception", exit code -6; a
2-rank data-parallel run did so intermittently). `nnscaler.init` registers
`teardown` to run at exit; `nnscaler.uninit` runs it at once."""

from __future__ import annotations

import atexit
import gc
import weakref
from typing import Any

__all__ = ["track", "release_parallel_modules", "register_teardown"]

_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()
_REGISTERED = [False]


def track(module: Any) -> None:
    """Remember a ParallelModule (weakly) so teardown can release its reducer first."""
    _LIVE.add(module)


def release_parallel_modules() -> None:
    """Drop every live ParallelModule's reducer (its buckets and the gradients that view them)."""
    for module in list(_LIVE):
        module._drop_reducer()
    gc.collect()  # the buckets go now, before the process groups, not during interpreter shutdown


def register_teardown(teardown: Any) -> None:
    """Run `teardown()` at interpreter exit (once, however often init is called)."""
    if not _REGISTERED[0]:
        atexit.register(teardown)
        _REGISTERED[0] = True
