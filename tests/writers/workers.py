"""Rank functions of the multi-process writer tests (spawned by tests.dist_util.spawn)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def rank_dir_worker(rank: int, world: int, final: str) -> dict[str, Any]:
    """Every rank writes its file into `final` (twice: the second replaces the first)."""
    from nnscaler.runtime.checkpoint.files import write_rank_dir

    final_p = Path(final)
    for step in (1, 2):
        files = {f"{rank}.ckpt": {"rank": rank, "step": step, "w": torch.full((4,), float(rank + step))}}
        write_rank_dir(final_p, final_p.with_name(".tmp"), final_p.with_name(".old"), rank, files)
    return {"ok": True}


def refused_worker(rank: int, world: int, final: str) -> str:
    """`final` is a file: every rank gets the CheckpointError (no rank left waiting at a barrier)."""
    from nnscaler.errors import CheckpointError
    from nnscaler.runtime.checkpoint.files import write_rank_dir

    final_p = Path(final)
    try:
        write_rank_dir(
            final_p, final_p.with_name(".tmp"), final_p.with_name(".old"), rank, {f"{rank}.ckpt": {}}
        )
    except CheckpointError as err:
        return str(err)
    return "not refused"


def broadcast_worker(rank: int, world: int, base: str) -> list[str]:
    """Each rank plays a machine of its own (its own directory, LOCAL_RANK 0) receiving rank 0's code."""
    from nnscaler.config import BroadcastGenFilesStrategy
    from nnscaler.parallel.parallelize import _broadcast_files

    os.environ["LOCAL_RANK"] = "0"
    outdir = Path(base) / f"machine{rank}"
    _broadcast_files(outdir, BroadcastGenFilesStrategy.ALL)
    return sorted(os.listdir(outdir))


def hf_export_worker(rank: int, world: int, out: str, blocked: str) -> list[str]:
    """Both ranks export a plain module (sharded) into `out`, then into `blocked`, a file: refused on both."""
    from nnscaler.errors import CheckpointError
    from nnscaler.integration.hf import save_pretrained
    from tests.integration import hf_case as H

    save_pretrained(H.build_qwen2(H.SOURCE_SEED), out, max_shard_size="40KB")
    try:
        save_pretrained(H.build_qwen2(H.SOURCE_SEED), blocked)
    except CheckpointError as err:
        return [str(err)]
    return ["not refused"]
