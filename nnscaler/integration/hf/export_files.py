"""The files of a Hugging Face export, written into the user's directory without touching anything else.

A directory passed to `save_pretrained` often holds the user's own files (a tokenizer, a README,
training checkpoints). The export writes only its own names there: the safetensors files, the
index (when sharded) and `config.json`, each through a temporary file in the same directory
(`.<name>.tmp-<pid>`: written, fsynced, `os.replace`d over the name, then the directory fsynced).
The order keeps a complete export readable at every moment:

1. the new safetensors files. A shard name that the previous index names is not reused (the new
   shards get a `-<tag>` suffix), so the previous index never points at a new file;
2. `config.json`;
3. the index (sharded) last: until it is replaced, readers see the previous export;
4. only then the previous export's leftovers: shards named by an index nnscaler wrote and not named
   by the new one, the previous index or `model.safetensors` when the export changes between one file
   and shards (only when nnscaler wrote them: both carry `"writer": "nnscaler"` in their metadata).

An export killed before its index leaves new shards that no index names (and temporary files): the
next export removes them (ours by their metadata; nothing when the index is unreadable) and names
them in a warning.

Refused (CheckpointError naming the path) before anything is written: a `path` that is a file, and a
`model.safetensors` or index that nnscaler did not write and that would be read instead of the new
export (a sharded export beside a foreign `model.safetensors`, one file beside a foreign index).
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nnscaler.errors import CheckpointError
from nnscaler.integration.hf.reader import INDEX_FILE, SINGLE_FILE
from nnscaler.runtime.checkpoint.files import atomic_save, fsync_dir

__all__ = [
    "WRITER_KEY",
    "WRITER",
    "ExportPlan",
    "plan_export",
    "write_tensors",
    "finish_export",
    "config_text",
]

WRITER_KEY, WRITER = "writer", "nnscaler"
"""Metadata entry marking a safetensors file / index as written by `save_pretrained`."""
CONFIG_FILE = "config.json"
logger = logging.getLogger(__name__)
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}(-[0-9a-f]{6})?\.safetensors$")
_TEMP = re.compile(r"^\.(model[-.].*safetensors(\.index\.json)?|config\.json)\.tmp-\d+$")


@dataclass
class ExportPlan:
    """Where rank 0 writes one export: the new file names and what the previous export left."""

    path: Path
    files: list[str]
    old_index: dict[str, Any] | None = None
    """The previous index as read (None: absent or unreadable)."""
    old_shards: set[str] = field(default_factory=set)
    """Files the previous index names (whoever wrote it)."""
    old_index_ours: bool = False
    old_single_ours: bool = False
    committed: bool = False
    """Whether the new index is in place (from then on the new shards are the export)."""


def _ours(metadata: Any) -> bool:
    return isinstance(metadata, Mapping) and metadata.get(WRITER_KEY) == WRITER


def _read_index(index: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(index.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("weight_map"), dict) else None


def _single_is_ours(file: Path) -> bool:
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            return _ours(f.metadata())
    except Exception:  # unreadable (truncated, not safetensors): not provably ours
        return False


def _orphans(path: Path, named: set[str]) -> list[str]:
    """Shards that an export killed before its index wrote (ours by their metadata), named by no index."""
    return sorted(
        p.name
        for p in path.iterdir()
        if _SHARD.match(p.name) and p.name not in named and p.is_file() and _single_is_ours(p)
    )


def plan_export(path: Path, n_files: int) -> ExportPlan:
    """Check `path`, create it, read the previous export and name the new files (rank 0)."""
    if path.exists() and not path.is_dir():
        raise CheckpointError(
            f"save_pretrained: {path} is a file, not a directory; the export writes config.json and "
            "model.safetensors into a directory: give a directory path, or move the file away"
        )
    path.mkdir(parents=True, exist_ok=True)
    left = []
    for stale in path.iterdir():  # temporary files of an export that crashed (our names only)
        if _TEMP.match(stale.name) and stale.is_file():
            stale.unlink(missing_ok=True)
            left.append(stale.name)
    plan = ExportPlan(path, [])
    index, single = path / INDEX_FILE, path / SINGLE_FILE
    if index.exists():
        plan.old_index = _read_index(index)
        if plan.old_index is not None:
            plan.old_shards = {str(v) for v in plan.old_index["weight_map"].values()}
            plan.old_index_ours = _ours(plan.old_index.get("metadata"))
    if single.exists():
        plan.old_single_ours = _single_is_ours(single)
    if plan.old_index is not None or not index.exists():  # with an unreadable index, remove nothing
        for name in _orphans(path, plan.old_shards):
            (path / name).unlink(missing_ok=True)
            left.append(name)
    if left:
        logger.warning(
            "save_pretrained: %s held what an interrupted export left (removed): %s",
            path,
            ", ".join(sorted(left)),
        )
    if n_files == 1:
        if index.exists() and not plan.old_index_ours:
            why = "cannot be read" if plan.old_index is None else "was not written by nnscaler"
            raise CheckpointError(
                f"save_pretrained: {index} {why}, and loaders read it before the "
                f"{SINGLE_FILE} this export writes; remove it (and its shards) or export into another directory"
            )
        plan.files = [SINGLE_FILE]
        return plan
    if single.exists() and not plan.old_single_ours:
        raise CheckpointError(
            f"save_pretrained: {single} was not written by nnscaler, and transformers reads it before the "
            f"{INDEX_FILE} of this sharded export; remove it or export into another directory"
        )
    names = [f"model-{k + 1:05d}-of-{n_files:05d}" for k in range(n_files)]
    if any(f"{n}.safetensors" in plan.old_shards for n in names):  # never rewrite a file the old index names
        tag = secrets.token_hex(3)
        names = [f"{n}-{tag}" for n in names]
    plan.files = [f"{n}.safetensors" for n in names]
    return plan


def _write_safetensors(target: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(target), metadata={"format": "pt", WRITER_KEY: WRITER})
    with open(target, "rb+") as f:
        os.fsync(f.fileno())


def _write_text(target: Path, text: str) -> None:
    with open(target, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_tensors(plan: ExportPlan, file: str, tensors: dict[str, torch.Tensor]) -> None:
    """One safetensors file, atomically (temporary file, fsync, rename, fsync of the directory)."""
    atomic_save(tensors, plan.path / file, _write_safetensors)


def config_text(config: Any, dtype: torch.dtype | None) -> str | None:
    """config.json's text from a PretrainedConfig or a dict, stating `dtype` (the tensors written)."""
    if config is None:
        return None
    if hasattr(config, "to_json_string"):
        data = json.loads(config.to_json_string())
    else:
        data = json.loads(json.dumps(dict(config), default=str))
    if dtype is not None:
        name = str(dtype).removeprefix("torch.")
        data["dtype"] = name  # transformers >= 4.56 reads `dtype`; older versions `torch_dtype`
        if "torch_dtype" in data:
            data["torch_dtype"] = name
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


def finish_export(
    plan: ExportPlan, weight_map: dict[str, str], total: int, numel: int, config: str | None
) -> None:
    """config.json, then the index (last of the new files), then the previous export's leftovers."""
    path = plan.path
    fsync_dir(path)  # the new shards' names are on disk before anything names them
    if config is not None:
        atomic_save(config, path / CONFIG_FILE, _write_text)
    sharded = plan.files != [SINGLE_FILE]
    if sharded:
        meta = {"total_size": total, "total_parameters": numel, WRITER_KEY: WRITER}
        index = {"metadata": meta, "weight_map": weight_map}
        atomic_save(json.dumps(index, indent=2, sort_keys=True) + "\n", path / INDEX_FILE, _write_text)
        plan.committed = True
        if plan.old_single_ours:
            _unlink(path / SINGLE_FILE)
    elif plan.old_index_ours:
        _unlink(path / INDEX_FILE)  # before its shards: a reader never sees an index missing its files
    if plan.old_index_ours:
        for name in sorted(plan.old_shards - set(plan.files)):
            target = path / name
            if target.parent == path and name != SINGLE_FILE:  # a name, not a path elsewhere
                _unlink(target)
    fsync_dir(path)


def abandon_export(plan: ExportPlan, written: list[str]) -> None:
    """After a failed sharded export: remove the new shards, which no index names (the previous
    export, untouched, stays readable). A single file replaced `model.safetensors` already: kept."""
    if plan.files == [SINGLE_FILE] or plan.committed:
        return
    for name in written:
        _unlink(plan.path / name)
