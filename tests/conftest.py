"""Suite-wide pytest setup: `gpu` tests skip, saying why, when no CUDA device is visible; no process group
outlives the test module that made it."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module", autouse=True)
def _no_process_group_outlives_its_module():
    """A test module that leaves a process group behind (Lightning's strategy initialises a 1-rank one
    in-process) would make a later module in the same pytest worker look distributed; close it."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
