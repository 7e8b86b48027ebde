"""Lightning checkpoints of a parallelized module: a directory with one file per rank
(`rank{r}.ckpt`, each Lightning's usual checkpoint dict with this rank's shard of the model and
optimizer), written atomically, and merged into one single-device Lightning checkpoint.

The directory is written as `<name>.tmp` by every rank and renamed by rank 0 once all are done, so
`<name>` is either absent, the previous checkpoint, or complete. The writing, reading and merging are
the runtime's (nnscaler.runtime.checkpoint), as for the CLI Trainer; this module keeps Lightning's
layout: the file names and which entries of Lightning's dict hold the state dicts.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from nnscaler.runtime.checkpoint import merge_state_dicts
from nnscaler.runtime.checkpoint.files import atomic_save, load_file, write_rank_dir

__all__ = [
    "META_KEY",
    "rank_file",
    "saved_state_dict_type",
    "write_rank_checkpoint",
    "read_rank_checkpoint",
    "remove_rank_checkpoint",
    "merge_checkpoint_files",
]

META_KEY = "nnscaler"
"""Entry of a rank's Lightning checkpoint dict with the strategy's metadata: `state_dict_type`, `rank`
(dropped from a merged checkpoint, which any plain LightningModule loads)."""


def rank_file(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.ckpt"


def saved_state_dict_type(checkpoint: dict[str, Any]) -> str | None:
    """The `state_dict_type` a rank's checkpoint dict was saved with (None: not by the strategy)."""
    return checkpoint.get(META_KEY, {}).get("state_dict_type")


def write_rank_checkpoint(checkpoint: dict[str, Any], directory: str | os.PathLike, rank: int) -> Path:
    """Every rank calls it with its own dict; returns the finished directory."""
    final = Path(directory)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    files = {rank_file(tmp, rank).name: checkpoint}
    return write_rank_dir(final, tmp, final.with_name(final.name + ".old"), rank, files)


def remove_rank_checkpoint(directory: str | os.PathLike) -> None:
    """Delete a checkpoint `write_rank_checkpoint` wrote (Lightning's `remove_checkpoint`, e.g. beyond
    `save_top_k`): its `rank{r}.ckpt` files, and the directory when nothing else is left in it. Files a
    user put into the directory stay (with the directory)."""
    path = Path(directory)
    if not path.is_dir() or path.is_symlink():
        return
    for f in path.glob("rank*.ckpt"):
        if f.name[4:-5].isdigit() and f.is_file():
            f.unlink(missing_ok=True)
    try:
        path.rmdir()  # only when empty
    except OSError:
        pass


def read_rank_checkpoint(directory: str | os.PathLike, rank: int, world_size: int) -> dict[str, Any]:
    path = Path(directory)
    if path.is_file():
        raise ValueError(
            f"{path} is a single file, not a NnScalerStrategy checkpoint directory (rank{{r}}.ckpt per rank); "
            "a merged checkpoint loads into the plain LightningModule: module.load_state_dict(ckpt['state_dict'])"
        )
    files = sorted(path.glob("rank*.ckpt"))
    if len(files) != world_size:
        raise ValueError(
            f"checkpoint {path} holds {len(files)} rank files but this run has {world_size} ranks: resume "
            "with the ComputeConfig it was saved with, or merge it (NnScalerStrategy.merge_checkpoint) and "
            "load the merged weights"
        )
    return load_file(rank_file(path, rank))


def merge_checkpoint_files(checkpoint_files: list[str | os.PathLike], output_file: str | os.PathLike) -> None:
    """Rank files (or checkpoint directories) -> one Lightning checkpoint with the single-device
    module's state dict (original names) and optimizer state; the rest is rank 0's."""
    paths: list[Path] = []
    for f in checkpoint_files:
        f = Path(f)
        paths.extend(sorted(f.glob("rank*.ckpt"), key=lambda p: int(p.stem[4:])) if f.is_dir() else [f])
    if not paths:
        raise ValueError(f"merge_checkpoint: no rank files in {[str(f) for f in checkpoint_files]}")
    ranks = [load_file(p) for p in paths]
    has_opt = all(r.get("optimizer_states") for r in ranks)
    model, opt = merge_state_dicts(
        [r["state_dict"] for r in ranks], [r["optimizer_states"][0] for r in ranks] if has_opt else None
    )
    merged = dict(ranks[0])
    merged["state_dict"] = model
    merged["optimizer_states"] = [opt] if has_opt else []
    merged.pop(META_KEY, None)
    out = Path(output_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_save(merged, out)
