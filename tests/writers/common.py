"""A directory of a user's own files, and the check that every one survived byte-identical."""

from __future__ import annotations

import os
from pathlib import Path

USER_FILES = {
    "tokenizer.json": b'{"model": {"type": "BPE"}}\n',
    "README.md": b"# my model\nnotes the writer must keep\n",
    "checkpoints/step100.ckpt": bytes(range(256)) * 4,
    "notes/run.txt": b"lr=3e-4\n",
}


def plant(directory: Path, files: dict[str, bytes] = USER_FILES) -> dict[str, bytes]:
    """Write `files` (relative path -> bytes) under `directory`; returns them."""
    for rel, data in files.items():
        target = directory / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return dict(files)


def assert_kept(directory: Path, files: dict[str, bytes]) -> None:
    """Every planted file is still there with the same bytes."""
    lost = [rel for rel in files if not (directory / rel).is_file()]
    assert not lost, f"the writer deleted {lost} from {directory} (left: {sorted(os.listdir(directory))})"
    changed = [rel for rel, data in files.items() if (directory / rel).read_bytes() != data]
    assert not changed, f"the writer changed {changed} in {directory}"
