"""Lightning checkpoints of a parallelized module: a directory with one file per rank
(`rank{r}.ckpt`, each Lightning's usual checkpoint dict with this rank's shard of the model and
optimizer), written atomically, and merged into one single-device Lightning checkpoint.

The directory is written as `<name>.tmp` by every rank and renamed by rank 0 once all are done, so
`<name>` is either absent, the previous checkpoint, or complete. (The CLI Trainer's checkpoint
writer does the same; the two packages are independent layers, hence this short twin.)
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nnscaler.runtime import merge_state_dicts

__all__ = ["rank_file", "write_rank_checkpoint", "read_rank_checkpoint", "merge_checkpoint_files"]


def rank_file(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.ckpt"


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _save(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.part")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_rank_checkpoint(checkpoint: dict[str, Any], directory: str | os.PathLike, rank: int) -> Path:
    """Every rank calls it with its own dict; returns the finished directory."""
    final = Path(directory)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    _save(checkpoint, rank_file(tmp, rank))
    _barrier()
    if rank == 0:
        if final.exists():
            old = final.with_name(final.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    _barrier()
    return final


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
    return torch.load(rank_file(path, rank), map_location="cpu", weights_only=False)


def merge_checkpoint_files(checkpoint_files: list[str | os.PathLike], output_file: str | os.PathLike) -> None:
    """Rank files (or checkpoint directories) -> one Lightning checkpoint with the single-device
    module's state dict (original names) and optimizer state; the rest is rank 0's."""
    paths: list[Path] = []
    for f in checkpoint_files:
        f = Path(f)
        paths.extend(sorted(f.glob("rank*.ckpt"), key=lambda p: int(p.stem[4:])) if f.is_dir() else [f])
    if not paths:
        raise ValueError(f"merge_checkpoint: no rank files in {[str(f) for f in checkpoint_files]}")
    ranks = [torch.load(p, map_location="cpu", weights_only=False) for p in paths]
    has_opt = all(r.get("optimizer_states") for r in ranks)
    model, opt = merge_state_dicts(
        [r["state_dict"] for r in ranks], [r["optimizer_states"][0] for r in ranks] if has_opt else None
    )
    merged = dict(ranks[0])
    merged["state_dict"] = model
    merged["optimizer_states"] = [opt] if has_opt else []
    merged.pop("nnscaler", None)
    out = Path(output_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    _save(merged, out)
