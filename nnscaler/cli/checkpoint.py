"""Trainer checkpoints on disk: atomic directories, `last` / `best` pointers, pruning, loading.

Layout under `save_dir` (nnScaler's): `{epoch:04d}-{step:04d}/{rank}.ckpt` (sharded, deduped) or
`.../merged.ckpt` (merged), plus `last` and `best` (relative symlinks, or copies). Each directory
ends with `complete.json` (save type, world size, the plan of each rank), written last.

Atomicity: every rank writes its file into `.tmp-{name}/` (temporary file, fsync, rename); after a
barrier rank 0 writes `complete.json`, fsyncs, renames the directory to `{name}` and only then
repoints `last` (a new symlink renamed over the old one). A process killed at any point leaves the
previous checkpoint and `last` intact; stale `.tmp-*` directories are removed by the next save.
The atomic writing is the runtime's (nnscaler.runtime.checkpoint.files); this module keeps the
Trainer's layout: file names, `complete.json`, pointers and pruning.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nnscaler.errors import CheckpointError
from nnscaler.runtime.checkpoint.files import (
    atomic_save,
    barrier,
    fsync_dir,
    write_fsynced,
    write_rank_dir,
)
from nnscaler.runtime.checkpoint.files import load_file as read_torch_file

__all__ = [
    "COMPLETE_FILE",
    "MERGED_FILE",
    "rank_file",
    "write_checkpoint_dir",
    "checkpoint_info",
    "resolve_checkpoint",
    "point",
    "prune",
    "step_dirs",
    "barrier",
    "atomic_torch_save",
]

COMPLETE_FILE = "complete.json"
MERGED_FILE = "merged.ckpt"


def rank_file(directory: Path, rank: int) -> Path:
    return Path(directory) / f"{rank}.ckpt"


def _write_file(path: Path, obj: Any) -> None:
    """torch.save into an open file and fsync it (tests replace this to crash mid-write)."""
    write_fsynced(path, obj)


def atomic_torch_save(obj: Any, path: Path) -> None:
    """torch.save to `path` through a temporary file: `path` is either absent, old, or complete."""
    atomic_save(obj, path, _write_file)


def write_checkpoint_dir(
    save_dir: Path,
    name: str,
    rank: int,
    files: dict[str, Any],
    info: dict[str, Any],
) -> Path:
    """Write this rank's `files` (file name -> object) into `save_dir/name` atomically (all ranks
    call it; rank 0 finishes the directory with `complete.json`). Returns the final directory."""
    save_dir = Path(save_dir)
    if rank == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        for stale in save_dir.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)

    def finish(tmp: Path) -> None:
        (tmp / COMPLETE_FILE).write_text(json.dumps(info, indent=1, sort_keys=True))

    return write_rank_dir(
        save_dir / name,
        save_dir / f".tmp-{name}",
        save_dir / f".tmp-old-{name}",
        rank,
        files,
        write=_write_file,
        finish=finish,
    )


def point(save_dir: Path, pointer: str, target: Path, symlink: bool = True) -> None:
    """Make `save_dir/pointer` (`last`, `best`) refer to checkpoint directory `target` (rank 0 only):
    a relative symlink, or a copy. The new pointer is complete before it replaces the old one."""
    save_dir = Path(save_dir)
    link = save_dir / pointer
    tmp = save_dir / f".tmp-{pointer}"
    _remove(tmp)
    if symlink:
        os.symlink(os.path.relpath(target, save_dir), tmp)
    else:
        shutil.copytree(target, tmp)
        fsync_dir(tmp)
    if link.is_dir() and not link.is_symlink():  # a copy: a directory cannot be renamed over
        old = save_dir / f".tmp-old-{pointer}"
        _remove(old)
        os.replace(link, old)
        os.replace(tmp, link)
        _remove(old)
    elif link.is_symlink() and not symlink:  # neither can a symlink by a directory
        link.unlink()
        os.replace(tmp, link)
    else:
        os.replace(tmp, link)
    fsync_dir(save_dir)


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def step_dirs(save_dir: Path) -> list[Path]:
    """The complete `{epoch}-{step}` checkpoint directories, oldest first (by step)."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    found = []
    for d in save_dir.iterdir():
        parts = d.name.split("-")
        if len(parts) == 2 and all(p.isdigit() for p in parts) and (d / COMPLETE_FILE).exists():
            found.append((int(parts[1]), int(parts[0]), d))
    return [d for *_, d in sorted(found)]


def prune(save_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` step checkpoints, never one that `last` or `best` points to."""
    save_dir = Path(save_dir)
    pinned = {(save_dir / p).resolve() for p in ("last", "best") if (save_dir / p).is_symlink()}
    dirs = step_dirs(save_dir)
    for d in dirs[: max(0, len(dirs) - keep)]:
        if d.resolve() not in pinned:
            shutil.rmtree(d, ignore_errors=True)


def resolve_checkpoint(path: Path) -> Path:
    """A complete checkpoint directory (or merged file) at `path`; CheckpointError naming the path otherwise."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.is_file():
        return path
    if not (path / COMPLETE_FILE).exists():
        raise CheckpointError(
            f"checkpoint {path} is incomplete (no {COMPLETE_FILE}: its write was interrupted); "
            "resume from an earlier checkpoint"
        )
    return path


def checkpoint_info(path: Path) -> dict[str, Any]:
    """The `complete.json` of a checkpoint directory ({} for a single merged file)."""
    path = Path(path)
    if path.is_file():
        return {"save_type": "merged", "files": [path.name]}
    return json.loads((path / COMPLETE_FILE).read_text())


def load_file(path: Path, convert_fn: Callable[[dict], dict] | None = None) -> dict[str, Any]:
    """torch.load a checkpoint file (weights_only=False: the file holds train args and RNG states),
    then `convert_fn` on it."""
    data = read_torch_file(path)
    return convert_fn(data) if convert_fn is not None else data
