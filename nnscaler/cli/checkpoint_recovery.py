"""What an interrupted checkpoint save left under `save_dir`, put right and reported.

A save killed at any point (see nnscaler.cli.checkpoint) leaves the previous checkpoint and `last`
usable, plus some of these leftovers, which `recover_save_dir` (rank 0, before a run resumes or
saves) handles and names in a warning:

- `.tmp-{step}/`: a step directory still being written: removed. Killed between the two renames
  that replace an existing `{step}` (`.tmp-old-{step}` holds the previous one, `{step}` is absent),
  the finished `.tmp-{step}` becomes `{step}`; unfinished, `.tmp-old-{step}` is put back.
- `.tmp-old-{step}/`: the replaced copy of a step directory: removed once `{step}` is there.
- `.pruned-{step}/`: a step directory that pruning had started to delete: removed.
- `.last.new`, `.last.old` (and `best`'s): a pointer being swapped: the swap is finished.

Then the warning says which complete checkpoint `last` refers to, and names a complete step
directory newer than it (a save interrupted after its directory was renamed into place but before
`last` moved); `last` is left as it is (the step directories of a resumed run need not be newest).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from nnscaler.cli.checkpoint_pointers import (
    COMPLETE_FILE,
    POINTERS,
    pointer_entries,
    pointer_path,
    pointer_target,
    repair,
)
from nnscaler.runtime.checkpoint.files import fsync_dir

__all__ = ["recover_save_dir", "PRUNED_PREFIX", "is_step_name"]

PRUNED_PREFIX = ".pruned-"
_TMP, _TMP_OLD = ".tmp-", ".tmp-old-"

logger = logging.getLogger("nnscaler.cli.checkpoint")


def is_step_name(name: str) -> bool:
    parts = name.split("-")
    return len(parts) == 2 and all(p.isdigit() for p in parts)


def _complete(d: Path) -> bool:
    return d.is_dir() and (d / COMPLETE_FILE).is_file()


def _step_leftovers(save_dir: Path) -> list[str]:
    """Finish or undo interrupted step-directory writes and prunes; one line per leftover."""
    found = []
    names = sorted(p.name for p in save_dir.iterdir())
    for name in names:
        path = save_dir / name
        if name.startswith(PRUNED_PREFIX):
            shutil.rmtree(path, ignore_errors=True)
            found.append(f"{name} (a pruned checkpoint not yet deleted): removed")
        elif name.startswith(_TMP) and not name.startswith(_TMP_OLD) and is_step_name(name[len(_TMP) :]):
            step = name[len(_TMP) :]
            final, old = save_dir / step, save_dir / f"{_TMP_OLD}{step}"
            if not final.exists() and old.exists() and _complete(path):
                os.replace(path, final)  # killed between the renames: the new directory was finished
                found.append(f"{name} (finished, its rename into place interrupted): renamed to {step}")
            else:
                shutil.rmtree(path, ignore_errors=True)
                found.append(f"{name} (an interrupted checkpoint write): removed")
    for name in names:
        old = save_dir / name
        if name.startswith(_TMP_OLD) and is_step_name(name[len(_TMP_OLD) :]) and old.exists():
            step = name[len(_TMP_OLD) :]
            if (save_dir / step).exists():
                shutil.rmtree(old, ignore_errors=True)
                found.append(f"{name} (the replaced copy of {step}): removed")
            else:
                os.replace(old, save_dir / step)
                found.append(
                    f"{name} (the previous {step}, its replacement unfinished): renamed back to {step}"
                )
    return found


def _pointer_leftovers(save_dir: Path) -> list[str]:
    found = []
    for pointer in POINTERS:
        stale = [p.name for p in pointer_entries(save_dir, pointer) if p.name != pointer]
        if stale:
            repair(save_dir, pointer)
            found.append(f"{', '.join(stale)} (`{pointer}` was being moved): the move was finished")
    return found


def _summary(save_dir: Path) -> str:
    last = pointer_path(save_dir, "last")
    target = pointer_target(last) if last is not None else None
    if last is None or not _complete(last):
        return "there is no complete `last` checkpoint"
    shown = target.name if target is not None else "a copy"
    text = f"`last` -> {shown} is the newest complete checkpoint it names"
    if target is not None:
        newer = [
            d.name
            for d in save_dir.iterdir()
            if is_step_name(d.name) and _complete(d) and _order(d.name) > _order(target.name)
        ]
        if newer:
            text += (
                f"; {', '.join(sorted(newer))} is complete but newer than `last` (a save interrupted before "
                "`last` moved, or an earlier run's): give checkpoint.resume_from its path to resume from it"
            )
    return text


def _order(name: str) -> tuple[int, int]:
    epoch, step = name.split("-")
    return int(step), int(epoch)


def recover_save_dir(save_dir: Path) -> list[str]:
    """Put right what interrupted saves left under `save_dir` (rank 0 only) and warn naming each
    leftover and the checkpoint `last` now refers to. Returns the warning's lines (empty: nothing found)."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    found = _step_leftovers(save_dir) + _pointer_leftovers(save_dir)
    if not found:
        return []
    fsync_dir(save_dir)
    lines = found + [_summary(save_dir)]
    logger.warning(
        "checkpoint.save_dir %s: found what an interrupted save left: %s", save_dir, "; ".join(lines)
    )
    return lines
