"""Trainer checkpoints on disk: atomic directories, `last` / `best` pointers, pruning, loading.

Layout under `save_dir` (nnScaler 0.8's): `{epoch:04d}-{step:04d}/{rank}.ckpt` (sharded, deduped) or
`.../merged.ckpt` (merged), plus `last` and `best`: directories of relative links to the files of a
step directory (or copies; nnscaler.cli.checkpoint_pointers). Each step directory ends with
`complete.json` (save type, world size, the plan of each rank), written last. A run that starts
afresh moves an earlier run's checkpoints into `earlier_runs/{UTC time}/` (`archive_earlier_run`).

Atomicity: every rank writes its file into `.tmp-{name}/` (temporary file, fsync, rename); after a
barrier rank 0 writes `complete.json`, fsyncs, renames the directory to `{name}` and only then
repoints `last` (built under `.last.new`, then swapped in). A process killed at any point leaves the
previous checkpoint and `last` usable; what it left (`.tmp-*` directories, a pointer half swapped, a
prune half done) is put right and reported by the next resume or save (nnscaler.cli.checkpoint_recovery).
The atomic writing is the runtime's (nnscaler.runtime.checkpoint.files); this module keeps the
Trainer's layout: file names, `complete.json`, pointers and pruning.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nnscaler.cli.checkpoint_pointers import POINTERS, point, pointer_entries, pointer_path, pointer_target
from nnscaler.cli.checkpoint_recovery import PRUNED_PREFIX, is_step_name, recover_save_dir
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
    "pointer_path",
    "pointer_target",
    "archive_earlier_run",
    "EARLIER_RUNS",
    "POINTERS",
    "prune",
    "step_dirs",
    "barrier",
    "atomic_torch_save",
    "recover_save_dir",
]

COMPLETE_FILE = "complete.json"
MERGED_FILE = "merged.ckpt"
EARLIER_RUNS = "earlier_runs"

logger = logging.getLogger(__name__)


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
        recover_save_dir(save_dir)  # what an interrupted save left: removed (or finished), with a warning

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


def step_dirs(save_dir: Path) -> list[Path]:
    """The complete `{epoch}-{step}` checkpoint directories directly under `save_dir` (not those of
    `earlier_runs/`), oldest first (by step)."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    found = []
    for d in save_dir.iterdir():
        if is_step_name(d.name) and (d / COMPLETE_FILE).exists():
            parts = d.name.split("-")
            found.append((int(parts[1]), int(parts[0]), d))
    return [d for *_, d in sorted(found)]


def _pinned(save_dir: Path) -> set[Path]:
    """The step directories that `last` / `best` (or their in-flight names) link into."""
    targets = (pointer_target(p) for name in POINTERS for p in pointer_entries(save_dir, name))
    return {t for t in targets if t is not None}


def _is_ours(name: str) -> bool:
    """A name the Trainer writes into a step directory: rank files, the merged file, complete.json."""
    stem, dot, ext = name.partition(".")
    return name in (COMPLETE_FILE, MERGED_FILE) or (stem.isdigit() and dot == "." and ext == "ckpt")


def prune(save_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` step checkpoints, never one that `last` or `best` links into.

    A step directory holding files the Trainer did not write (a user's notes, an evaluation's output)
    loses only the Trainer's files, `complete.json` first (so it is no longer a checkpoint), and stays
    with the user's files, with a warning naming them."""
    save_dir = Path(save_dir)
    pinned = _pinned(save_dir)
    dirs = step_dirs(save_dir)
    for d in dirs[: max(0, len(dirs) - keep)]:
        if d.resolve() in pinned:
            continue
        foreign = sorted(p.name for p in d.iterdir() if not _is_ours(p.name))
        if foreign:
            (d / COMPLETE_FILE).unlink()
            for p in d.iterdir():
                if _is_ours(p.name):
                    p.unlink()
            fsync_dir(d)
            logger.warning(
                "checkpoint %s pruned (keep_last_n_checkpoints=%d): its checkpoint files are deleted, the "
                "directory stays because it holds files nnscaler did not write: %s",
                d,
                keep,
                ", ".join(foreign),
            )
            continue
        # renamed first: a prune killed half way never leaves a step directory missing files
        gone = d.with_name(PRUNED_PREFIX + d.name)
        os.replace(d, gone)
        shutil.rmtree(gone, ignore_errors=True)


def resolve_checkpoint(path: Path) -> Path:
    """A complete checkpoint directory (or merged file) at `path`; CheckpointError naming the path otherwise."""
    path = Path(path)
    if not path.exists() and path.name in POINTERS:  # a crash between the renames of point()
        path = pointer_path(path.parent, path.name) or path
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


def _earlier_entries(save_dir: Path) -> list[Path]:
    """What an earlier run left under `save_dir`: pointers first (moving them first keeps what is left
    consistent), then its step directories (complete or not)."""
    entries = [p for name in POINTERS for p in pointer_entries(save_dir, name)]
    return entries + sorted(d for d in save_dir.iterdir() if is_step_name(d.name) and d.is_dir())


def archive_earlier_run(save_dir: Path) -> Path | None:
    """Move an earlier run's checkpoints (step directories, `last`, `best`) into
    `save_dir/earlier_runs/{UTC time}/` (rank 0, before a fresh run writes anything): nothing is
    overwritten or deleted, and relative links stay valid as they move together. Returns the
    destination, or None when there was nothing to move."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return None
    entries = _earlier_entries(save_dir)
    if not entries:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest, n = save_dir / EARLIER_RUNS / stamp, 1
    while dest.exists():
        dest, n = save_dir / EARLIER_RUNS / f"{stamp}-{n}", n + 1
    dest.mkdir(parents=True)
    for entry in entries:
        os.replace(entry, dest / entry.name)
    fsync_dir(dest)
    fsync_dir(save_dir)
    logger.warning(
        "checkpoint.save_dir %s held the checkpoints of an earlier run and this run starts afresh: moved them "
        "to %s (to continue that run instead, give checkpoint.resume_from one of its checkpoints there)",
        save_dir,
        dest,
    )
    return dest


def checkpoint_info(path: Path) -> dict[str, Any]:
    """The `complete.json` of a checkpoint directory ({} for a single merged file)."""
    path = Path(path)
    if path.is_file():
        return {"save_type": "merged", "files": [path.name]}
    try:
        return json.loads((path / COMPLETE_FILE).read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {path} is incomplete (no {COMPLETE_FILE}: its write was interrupted); "
            "resume from an earlier checkpoint"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(
            f"checkpoint {path / COMPLETE_FILE} cannot be read ({err}); it is damaged: resume from an "
            "earlier checkpoint"
        ) from err


def load_file(path: Path, convert_fn: Callable[[dict], dict] | None = None) -> dict[str, Any]:
    """torch.load a checkpoint file (weights_only=False: the file holds train args and RNG states),
    then `convert_fn` on it."""
    data = read_torch_file(path)
    return convert_fn(data) if convert_fn is not None else data
