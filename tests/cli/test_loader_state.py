"""A training dataloader whose state_dict() exists but cannot answer (accelerate's DataLoaderShard over
a plain DataLoader) is saved as no state, so the run resumes by skipping samples instead of crashing
at its first checkpoint (nnScaler 0.8's vit_cli example, issue 43)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from nnscaler.cli.loader_state import loader_state


class ShardLike(torch.utils.data.DataLoader):
    """As accelerate's DataLoaderShard: state_dict() returns an attribute set only over a stateful loader."""

    def state_dict(self):
        return self.dl_state_dict

    def load_state_dict(self, state):
        raise AssertionError("not called")


def test_a_loader_that_cannot_give_its_state_is_saved_as_none(caplog):
    loader = ShardLike(list(range(8)), batch_size=2)
    with caplog.at_level(logging.WARNING, logger="nnscaler.cli.loader_state"):
        assert loader_state(SimpleNamespace(loaders={"train": (loader, None)})) is None
    assert "ShardLike" in caplog.text and "skips the samples already seen" in caplog.text


def test_accelerate_shard_over_a_plain_loader():
    accelerate = pytest.importorskip("accelerate.data_loader")
    shard = accelerate.DataLoaderShard(list(range(8)), batch_size=2)
    assert loader_state(SimpleNamespace(loaders={"train": (shard, None)})) is None
