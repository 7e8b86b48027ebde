"""nnScaler 0.8's user helpers (`nnscaler.utils`), as its examples and docs call them: the logger level,
a per-rank print, a rank-0-only decorator, and DataLoaders forced to zero workers.

A leaf: it imports only torch and the standard library, so any layer (and user scripts) may use it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

__all__ = [
    "set_default_logger_level",
    "print_each_rank",
    "rank_zero_only",
    "enforce_zero_num_worker",
]

_FORMAT = "%(asctime)s | %(levelname)s | %(name)s | %(message)s"
_DATEFMT = "%Y-%m-%d %H:%M:%S"


def set_default_logger_level(level: int | str) -> None:
    """Log `level` (logging.INFO or 'INFO') and above from nnscaler's loggers.

    As nnScaler 0.8: Python's root logger gets a handler with a timestamped format (`logging.basicConfig`,
    so only when it has none yet); and the `nnscaler` logger, parent of every module's logger, is set to
    `level` so the compiler's messages pass whatever the root logger's level was.
    """
    logging.basicConfig(level=level, format=_FORMAT, datefmt=_DATEFMT)
    logging.getLogger("nnscaler").setLevel(level)


def _rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one (a single process)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def print_each_rank(msg: str, rank_only: int | None = None, logger: logging.Logger | None = None) -> None:
    """Print 'rank [r]: msg' on every rank in rank order (or only on `rank_only`), through
    `logger.info` when given.

    With a process group every rank must call it: the ranks take turns, a barrier after each turn (as
    nnScaler 0.8). Without one (a single process) it prints as rank 0 and waits for nobody.
    """
    emit: Callable[[str], Any] = (lambda text: print(text, flush=True)) if logger is None else logger.info
    rank, world = _rank_and_world()
    for turn in range(world):
        if turn == rank and (rank_only is None or rank_only == rank):
            emit(f"rank [{rank}]: {msg}")
        if world > 1:
            dist.barrier()


def rank_zero_only(fn: Callable[..., None]) -> Callable[..., None]:
    """Decorate `fn` (logging, printing: no result, no side effect other ranks rely on) to run only
    on global rank 0, or in a process without a process group."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> None:
        if _rank_and_world()[0] == 0:
            fn(*args, **kwargs)

    return wrapped


@contextmanager
def enforce_zero_num_worker(cls: type) -> Iterator[None]:
    """Within the block, DataLoaders built from `cls` (e.g. torch.utils.data.DataLoader) load in the
    main process: num_workers 0, no prefetch_factor, no persistent workers; restored on exit."""
    original = cls.__init__

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.update(num_workers=0, prefetch_factor=None, persistent_workers=False)
        original(self, *args, **kwargs)

    cls.__init__ = init  # type: ignore[misc]
    try:
        yield
    finally:
        cls.__init__ = original  # type: ignore[misc]
