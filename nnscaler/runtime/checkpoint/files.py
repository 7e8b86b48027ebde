"""Checkpoint files on disk, written so that a crash never leaves half of one.

`atomic_save` writes a torch file through a temporary file (fsynced, then renamed over the target);
`write_rank_dir` fills a directory with every rank's files under a temporary name and lets rank 0
rename it into place once all are written, so the final name is absent, the previous checkpoint, or
complete; `load_file` reads a file back with errors that name it. The CLI Trainer and the Lightning
strategy lay out their own directories (file names, pointers, metadata) on top of these.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nnscaler.errors import CheckpointError

__all__ = [
    "Writer",
    "barrier",
    "fsync_dir",
    "write_fsynced",
    "atomic_save",
    "replace_dir",
    "write_rank_dir",
    "load_file",
]

Writer = Callable[[Path, Any], None]
"""Writes an object into a file path (by default `write_fsynced`; tests pass one that crashes)."""


def barrier() -> None:
    """Wait for every rank (a no-op without a process group, or alone in it)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (renames, new files) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_fsynced(path: Path, obj: Any) -> None:
    """torch.save `obj` into the file `path` and flush it to disk."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def atomic_save(obj: Any, path: str | os.PathLike, write: Writer = write_fsynced) -> None:
    """torch.save to `path` through a temporary file beside it: `path` is absent, old, or complete."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp, obj)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def replace_dir(tmp: Path, final: Path, old: Path) -> None:
    """Rename the finished directory `tmp` to `final`. An existing `final` is first renamed to `old`
    (a directory cannot be renamed over a full one) and deleted once the new one is in place."""
    if final.exists() or final.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(final.parent)


def write_rank_dir(
    final: str | os.PathLike,
    tmp: str | os.PathLike,
    old: str | os.PathLike,
    rank: int,
    files: Mapping[str, Any],
    *,
    write: Writer = write_fsynced,
    finish: Callable[[Path], None] | None = None,
) -> Path:
    """Write the directory `final` atomically; every rank calls it with its own `files` (file name ->
    object). Rank 0 creates `tmp` (remove a stale one first), every rank writes its files into it,
    then rank 0 calls `finish(tmp)` (e.g. to add a file written last) and renames `tmp` to `final`
    (`replace_dir`, through `old`). Returns `final` once every rank is past the rename."""
    final, tmp, old = Path(final), Path(tmp), Path(old)
    if rank == 0:
        tmp.mkdir(parents=True)
    barrier()
    for name, obj in files.items():
        atomic_save(obj, tmp / name, write)
    barrier()
    if rank == 0:
        if finish is not None:
            finish(tmp)
        fsync_dir(tmp)
        replace_dir(tmp, final, old)
    barrier()
    return final


def load_file(path: str | os.PathLike) -> Any:
    """torch.load a checkpoint file onto the CPU (weights_only=False: checkpoints hold training
    arguments and random states besides tensors); CheckpointError naming the path if it cannot."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except Exception as err:
        raise CheckpointError(f"checkpoint file {path} cannot be read: {err}") from err
