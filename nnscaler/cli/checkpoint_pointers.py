"""The Trainer's `last` / `best` pointers: real directories of links into a step directory.

As nnScaler 0.8 writes them, `save_dir/last` is a directory holding one relative symlink per file of
the step directory it points to (`last/0.ckpt -> ../0000-0025/0.ckpt`, `last/complete.json -> ...`),
so `glob('**/*.ckpt')` counts its files; with `symlink_best_and_last: false` they are copies.

Crash safety: the new pointer is built under `.{name}.new` (every file but `complete.json` first,
`complete.json` last, then fsync), then swapped in: `{name}` -> `.{name}.old`, `.{name}.new` ->
`{name}`, `.{name}.old` removed. A crash leaves `{name}` (old or new), or, between the two renames,
only `.{name}.new` (complete) and `.{name}.old`. Readers (`pointer_path`) take `{name}`, else a
complete `.{name}.new`, else `.{name}.old`; the next `point()` repairs the pointer and removes the
leftovers. `{name}` may also be a symlink to a step directory (the layout of earlier versions).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from nnscaler.runtime.checkpoint.files import fsync_dir

__all__ = ["POINTERS", "point", "pointer_path", "pointer_target", "pointer_entries", "is_complete", "repair"]

POINTERS = ("last", "best")
COMPLETE_FILE = "complete.json"


def _new(save_dir: Path, name: str) -> Path:
    return save_dir / f".{name}.new"


def _old(save_dir: Path, name: str) -> Path:
    return save_dir / f".{name}.old"


def pointer_entries(save_dir: Path, name: str) -> list[Path]:
    """`name` and its in-flight names (`.name.new`, `.name.old`, and the `.tmp-` names of earlier
    versions) that exist under `save_dir`."""
    save_dir = Path(save_dir)
    paths = [save_dir / name, _new(save_dir, name), _old(save_dir, name)]
    paths += [save_dir / f".tmp-{name}", save_dir / f".tmp-old-{name}"]
    return [p for p in paths if p.exists() or p.is_symlink()]


def pointer_target(pointer: Path) -> Path | None:
    """The step directory `pointer` refers to (resolved), or None for a copy or a missing pointer."""
    pointer = Path(pointer)
    if pointer.is_symlink():  # earlier versions: the pointer itself links to the step directory
        return pointer.resolve() if pointer.exists() else None
    marker = pointer / COMPLETE_FILE
    if not marker.is_symlink():
        return None
    return (pointer / os.readlink(marker)).resolve().parent


def is_complete(pointer: Path) -> bool:
    """Whether `pointer` is a finished pointer: its `complete.json` (linked or copied last) exists and,
    for links, every file of the step directory has a link that resolves."""
    pointer = Path(pointer)
    if not (pointer / COMPLETE_FILE).is_file():
        return False
    target = pointer_target(pointer)
    if target is None or pointer.is_symlink():
        return True
    return target.is_dir() and all((pointer / f.name).exists() for f in target.iterdir())


def pointer_path(save_dir: Path, name: str) -> Path | None:
    """The directory that pointer `name` stands for now: `save_dir/name`, else (a crash between the
    renames of `point()`) a complete `.name.new`, else `.name.old`; None when there is none."""
    save_dir = Path(save_dir)
    for candidate in (save_dir / name, _new(save_dir, name)):
        if candidate.exists() and is_complete(candidate):
            return candidate
    if (save_dir / name).exists():
        return save_dir / name  # incomplete: resolve_checkpoint names it
    old = _old(save_dir, name)
    return old if old.exists() else None


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def repair(save_dir: Path, name: str) -> None:
    """Finish a swap that a crash interrupted, then remove the in-flight names."""
    link = save_dir / name
    if not (link.exists() or link.is_symlink()):
        current = pointer_path(save_dir, name)
        if current is not None and current != link:
            os.replace(current, link)
    for stale in pointer_entries(save_dir, name):
        if stale != link:
            _remove(stale)


def _build(tmp: Path, target: Path, symlink: bool) -> None:
    """Fill `tmp` with a relative link (or a fsynced copy) of each file of `target`, `complete.json` last."""
    tmp.mkdir()
    files = sorted(target.iterdir(), key=lambda f: (f.name == COMPLETE_FILE, f.name))
    for f in files:
        if symlink:
            os.symlink(os.path.relpath(f, tmp), tmp / f.name)
        elif f.is_dir():
            shutil.copytree(f, tmp / f.name)
        else:
            shutil.copy2(f, tmp / f.name)
            with open(tmp / f.name, "rb+") as out:
                os.fsync(out.fileno())
    fsync_dir(tmp)


def point(save_dir: Path, pointer: str, target: Path, symlink: bool = True) -> None:
    """Make `save_dir/pointer` (`last`, `best`) refer to checkpoint directory `target` (rank 0 only):
    a directory of relative links to its files, or of copies. The new pointer is complete before it
    replaces the old one; leftovers of an interrupted earlier call are repaired first."""
    save_dir, target = Path(save_dir), Path(target)
    link, tmp, old = save_dir / pointer, _new(save_dir, pointer), _old(save_dir, pointer)
    repair(save_dir, pointer)
    _build(tmp, target, symlink)
    if link.exists() or link.is_symlink():
        os.replace(link, old)
        os.replace(tmp, link)
        _remove(old)
    else:
        os.replace(tmp, link)
    fsync_dir(save_dir)
