"""Resumable training dataloaders: one with `state_dict()` / `load_state_dict()` (torchdata's
StatefulDataLoader, mosaicml-streaming's StreamingDataLoader) is saved in each rank's checkpoint
(`dataloader`) and restored on resume, instead of skipping the samples already seen.

As in nnScaler 0.8: a merged checkpoint keeps every rank's state (a list); it is restored when all
ranks saved the same state, else the run falls back to skipping samples (with a warning).
"""

from __future__ import annotations

import logging
from typing import Any

from nnscaler.errors import CheckpointError

__all__ = ["is_resumable", "loader_state", "restore_loader"]

logger = logging.getLogger(__name__)


def is_resumable(loader: Any) -> bool:
    """The loader can save and restore its position itself."""
    return callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None)
    )


def loader_state(trainer: Any) -> Any:
    """The training dataloader's state for this rank's checkpoint (None: not resumable)."""
    loaders = getattr(trainer, "loaders", None) or {}
    loader = loaders["train"][0] if "train" in loaders else None
    if loader is None or not is_resumable(loader):
        return None
    try:
        return loader.state_dict()
    except (AttributeError, NotImplementedError) as err:
        # a wrapper that has the method but no state behind it, e.g. accelerate's DataLoaderShard over a
        # plain DataLoader (its state_dict reads a `dl_state_dict` only a stateful base loader sets)
        logger.warning(
            "the training dataloader (%s) cannot give its state (%s): the checkpoint keeps none and a "
            "resumed run skips the samples already seen",
            type(loader).__name__,
            err,
        )
        return None


def restore_loader(trainer: Any, saved: Any, merged: bool) -> bool:
    """Load `saved` (this rank's state, or every rank's list when `merged`) into the training
    dataloader; whether it was restored."""
    if saved is None or (merged and all(s is None for s in saved)):
        return False
    loader = trainer.loaders["train"][0]
    if not is_resumable(loader):
        raise CheckpointError(
            "the checkpoint holds a dataloader state but the training dataloader "
            f"({type(loader).__name__}) has no load_state_dict: use the dataloader type it was saved with"
        )
    if merged:
        if any(s != saved[0] for s in saved[1:]):
            logger.warning(
                "the ranks' dataloader states in the merged checkpoint differ: skipping the samples "
                "already seen instead of restoring them"
            )
            return False
        saved = saved[0]
    loader.load_state_dict(saved)
    return True
