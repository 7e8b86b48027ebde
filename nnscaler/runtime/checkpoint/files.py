"""Checkpoint files on disk, written so that a crash never leaves half of one.

`atomic_save` writes a torch file through a temporary file (fsynced, then renamed over the target);
`write_rank_dir` fills a directory with every rank's files under a temporary name and lets rank 0
rename it into place once all are written, so the final name is absent, the previous checkpoint, or
complete, and files in it that nnscaler did not write survive the replacement (`replace_dir`);
`load_file` reads a file back with errors that name it and say what to do. The CLI Trainer and the Lightning
strategy lay out their own directories (file names, pointers, metadata) on top of these.
"""

from __future__ import annotations

import ctypes
import os
import re
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
    "carry_foreign",
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


def _pattern(names: list[str]) -> re.Pattern[str]:
    """Names of the same kind as `names`: digit runs match any digits ("0.ckpt" also matches "12.ckpt")."""
    kinds = sorted({r"\d+".join(re.escape(p) for p in re.split(r"\d+", n)) for n in names})
    return re.compile("|".join(f"(?:{k})" for k in kinds) or "(?!)")


def _link_into(src: Path, dst: Path) -> None:
    """A second name for `src` at `dst` (hard links; copies where the file system has none)."""
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    elif src.is_dir():
        shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
    else:
        _link_or_copy(src, dst)


def _link_or_copy(src: str | Path, dst: str | Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def carry_foreign(final: Path, tmp: Path) -> list[str]:
    """Give every entry of `final` that nnscaler did not write a name in `tmp` too; returns them.

    Ours are the names `tmp` holds and names of the same kind (digit runs aside: a `3.ckpt` of an
    earlier run on more ranks beside the new `0.ckpt`); they are replaced or dropped with `final`.
    """
    if not final.is_dir() or final.is_symlink():
        return []
    ours = _pattern([p.name for p in tmp.iterdir()])
    kept = []
    for entry in sorted(final.iterdir()):
        if not ours.fullmatch(entry.name) and not (tmp / entry.name).exists():
            _link_into(entry, tmp / entry.name)
            kept.append(entry.name)
    return kept


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directory entries atomically: Linux renameat2(RENAME_EXCHANGE) through ctypes (the
    standard library has no binding). False where the platform or file system lacks it."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def replace_dir(tmp: Path, final: Path, old: Path) -> None:
    """Rename the finished directory `tmp` to `final`.

    An existing `final` directory is replaced whole only in what nnscaler wrote there: every other
    entry (a user's README.md, notes/, another tool's files) is first linked into `tmp`
    (`carry_foreign`), so it survives byte-identical in the new `final`. Then `tmp` and `final` are
    swapped in one atomic step where Linux allows (renameat2 RENAME_EXCHANGE) and the old directory,
    now at `tmp`, is deleted; elsewhere `final` is renamed to `old` (a directory cannot be renamed over
    a full one), `tmp` to `final`, and `old` is deleted (a crash between leaves `final` absent: callers
    such as nnscaler.cli.checkpoint_recovery finish the swap).
    A `final` that is a regular file is refused (CheckpointError): it is not a checkpoint of ours.
    """
    if final.is_file() and not final.is_symlink():
        raise CheckpointError(
            f"checkpoint directory {final} is a file; move it away or save the checkpoint under another name"
        )
    if final.exists() or final.is_symlink():
        carry_foreign(final, tmp)
        fsync_dir(tmp)
        if _exchange(tmp, final):  # one atomic step: a crash leaves `final` old or new, never absent
            old = tmp
        else:
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
    else:
        os.replace(tmp, final)
    fsync_dir(final.parent)


def _agree(error: BaseException | None) -> None:
    """Rank 0's error (or None) raised on every rank (a no-op without a process group)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [None if error is None else error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise error


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
    (`replace_dir`, through `old`): files in an existing `final` that nnscaler did not write are kept.
    A `final` that is a file is refused on every rank before anything is written. Returns `final`
    once every rank is past the rename.

    Sequence (rank 0 unless said): mkdir `tmp`; every rank: per file `.<name>.tmp-<pid>`, fsync,
    os.replace, fsync `tmp`; `finish(tmp)`; fsync `tmp`; link foreign entries of `final` into `tmp`,
    fsync `tmp`; swap `tmp` and `final` atomically (renameat2 RENAME_EXCHANGE; elsewhere rename
    `final` -> `old`, `tmp` -> `final`); rmtree the old directory; fsync the parent.
    """
    final, tmp, old = Path(final), Path(tmp), Path(old)
    error: BaseException | None = None
    if rank == 0:
        try:
            if final.is_file() and not final.is_symlink():
                raise CheckpointError(
                    f"checkpoint directory {final} is a file; move it away or save the checkpoint under another name"
                )
            tmp.mkdir(parents=True)
        except (OSError, CheckpointError) as err:
            error = err
    _agree(error)
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


_RELOAD = "load an earlier checkpoint, or save this one again"


def load_file(
    path: str | os.PathLike, *, weights_only: bool = False, mmap: bool = False, fix: str = _RELOAD
) -> Any:
    """torch.load a checkpoint file onto the CPU (weights_only=False by default: checkpoints hold training
    arguments and random states besides tensors); CheckpointError naming the path and `fix` if it cannot."""
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except Exception as err:
        raise CheckpointError(
            f"checkpoint file {path} cannot be read ({type(err).__name__}: {err}); it is truncated, damaged "
            f"or not a torch checkpoint: {fix}"
        ) from err
