"""A node's snapshot files: one directory per step, laid out as a Trainer checkpoint directory.

    {root}/step-00000012/{rank}.ckpt   a rank's state, the per-rank (`sharded`) checkpoint format
    {root}/step-00000012/{rank}.json   what it is: step, epoch, world size, plan, own or peer copy
    {root}/step-00000012/complete.json written when a restart resumes from this step

Plain files in tmpfs (/dev/shm) rather than a keeper process or a shared-memory library: the kernel
keeps them when the worker dies, any restarted worker on the node reads them by name, the write-then-
rename gives atomic files for free, and the existing resume path loads the directory as it stands.
A `.json` is written after its `.ckpt` is renamed into place, so a listed rank is a complete file.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

__all__ = ["step_dir", "write_atomic", "write_rank", "inventory", "clear", "prune_before", "reached_step"]

PREFIX = "step-"


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"{PREFIX}{step:08d}"


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary name in the same directory, then rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_rank(root: Path, step: int, rank: int, data: bytes, meta: dict[str, Any]) -> None:
    """Store rank `rank`'s serialized state of `step` and its description (the description last)."""
    d = step_dir(root, step)
    d.mkdir(parents=True, exist_ok=True)
    write_atomic(d / f"{rank}.ckpt", data)
    write_atomic(d / f"{rank}.json", json.dumps(meta).encode())


def _steps(root: Path) -> list[tuple[int, Path]]:
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for d in root.iterdir():
        if d.name.startswith(PREFIX) and d.name[len(PREFIX) :].isdigit():
            out.append((int(d.name[len(PREFIX) :]), d))
    return sorted(out)


def inventory(root: Path) -> dict[int, dict[int, dict[str, Any]]]:
    """{step: {rank: description}} of the complete rank files under `root`."""
    found: dict[int, dict[int, dict[str, Any]]] = {}
    for step, d in _steps(root):
        for meta_file in d.glob("*.json"):
            if not meta_file.stem.isdigit():
                continue
            try:
                meta = json.loads(meta_file.read_text())
            except (OSError, ValueError):
                continue  # removed or being replaced at this moment
            if (d / f"{meta_file.stem}.ckpt").exists():
                found.setdefault(step, {})[int(meta_file.stem)] = meta
    return found


def reached_step(root: Path) -> int:
    """The newest step a snapshot was started for under `root` (complete or not); -1 if none."""
    steps = _steps(root)
    return steps[-1][0] if steps else -1


def prune_before(root: Path, step: int, keep: int | None = None) -> None:
    """Delete the step directories older than `step` (except `keep`)."""
    for s, d in _steps(root):
        if s < step and s != keep:
            shutil.rmtree(d, ignore_errors=True)


def clear(root: Path) -> None:
    """Delete every snapshot under `root` (a fresh run: an earlier run's snapshots do not apply)."""
    for _, d in _steps(root):
        shutil.rmtree(d, ignore_errors=True)
