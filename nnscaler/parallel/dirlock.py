"""One compile at a time per output directory, across processes and machines sharing the disk.

The lock is `filelock.FileLock` on `.<outdir name>.lock` beside the output directory (so the
directory holds only generated files). It is an OS lock (flock on POSIX): the kernel drops it when
its holder dies, so a crashed job never leaves the directory locked. The lock file is never deleted:
deleting it would let a waiting job lock the old file while a new job locks a new one. A second job that
compiles the same module into the same gen_savedir waits, then finds the first job's code and
reuses it (or regenerates it, as its `reuse` says) instead of interleaving writes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from nnscaler.parallel.savedir import lock_file

__all__ = ["compile_lock"]

_log = logging.getLogger(__name__)


@contextlib.contextmanager
def compile_lock(outdir: Path) -> Iterator[None]:
    """Hold `outdir`'s lock (creating the directory), waiting as long as another compile holds it."""
    outdir.mkdir(parents=True, exist_ok=True)
    path = lock_file(outdir)
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        _log.warning("nnscaler: waiting for another compile into %s to finish (it holds %s)", outdir, path)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()
