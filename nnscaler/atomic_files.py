"""Write a file so that readers see the old file or the whole new one, never a part.

The bytes go to a temporary file with an unpredictable name (`tempfile.mkstemp`) in the target's
directory, are flushed to disk, and the temporary file is renamed over the target (`os.replace`,
atomic within one file system). Two writers of one path never share a temporary file, and no one
can plant a file or a link at a temporary name in advance. Temporary names start with a dot, so
listings of generated files (`nnscaler.parallel.savedir.generated_files`) skip them.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

__all__ = ["write_atomic"]


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write `data` (text as UTF-8) to `path` atomically; the directory must exist."""
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644 & ~_umask())  # mkstemp makes 0600; generated files are as readable as others
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _sync_dir(path.parent)


def _umask() -> int:
    """The process umask, read without changing it (os.umask would, for a moment, for every thread)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def _sync_dir(directory: Path) -> None:
    """Make the rename itself durable (where the platform allows opening a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
