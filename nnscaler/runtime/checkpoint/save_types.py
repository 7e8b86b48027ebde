"""The ways a checkpoint holds a parallel model, by the names checkpoints record them under.

`sharded`: every rank its own state dicts; `deduped`: the same without the copies that
data-parallel replicas hold (`deduped_state_dict`); `merged`: one single-device state dict
(`merge_state_dicts`). The CLI Trainer's `checkpoint.save_type` takes all three, the Lightning
strategy's `state_dict_type` the per-rank two; `local_state_dicts` and `load_local_state_dicts`
save and load those on each rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from nnscaler.runtime.checkpoint.load import (
    deduped_state_dict,
    load_deduped_state_dict,
    load_sharded_state_dict,
)

__all__ = [
    "SHARDED",
    "DEDUPED",
    "MERGED",
    "SAVE_TYPES",
    "PER_RANK_SAVE_TYPES",
    "local_state_dicts",
    "load_local_state_dicts",
]

SHARDED, DEDUPED, MERGED = "sharded", "deduped", "merged"
SAVE_TYPES = (SHARDED, DEDUPED, MERGED)
PER_RANK_SAVE_TYPES = (SHARDED, DEDUPED)
"""The save types of which every rank writes its own state dicts."""


def _check_per_rank(save_type: str) -> None:
    if save_type not in PER_RANK_SAVE_TYPES:
        raise ValueError(
            f"save type {save_type!r} is not saved per rank; use one of {list(PER_RANK_SAVE_TYPES)}"
        )


def local_state_dicts(
    module: nn.Module, optimizer: torch.optim.Optimizer | None, save_type: str
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """This rank's model and optimizer state dicts (None without an optimizer) as `save_type` keeps them."""
    _check_per_rank(save_type)
    if save_type == DEDUPED:
        return deduped_state_dict(module, optimizer)
    return module.state_dict(), optimizer.state_dict() if optimizer is not None else None


def load_local_state_dicts(
    module: nn.Module,
    save_type: str,
    module_state_dict: Mapping[str, Any],
    optimizer: torch.optim.Optimizer | None = None,
    optimizer_state_dict: Mapping[str, Any] | None = None,
) -> None:
    """Load what `local_state_dicts` gave on this rank, under the same plan."""
    _check_per_rank(save_type)
    load = load_deduped_state_dict if save_type == DEDUPED else load_sharded_state_dict
    load(module, module_state_dict, optimizer, optimizer_state_dict)
