# REPLACEMENT of nnScaler 0.8's tests/conftest.py: no autodist C++ build; its tests' GPU-count skip
# conditions are evaluated with 4 "devices" (their launcher here runs ranks as CPU processes with
# gloo), so tests needing 8 ranks stay skipped. CUDA is reported absent again once collected.
# Tests that need a package this environment lacks are skipped, naming it (an environment skip,
# not a failure): mosaicml-streaming (its install would replace torch) and wandb.
import importlib.util
from pathlib import Path

import pytest
import torch

_orig = (torch.cuda.is_available, torch.cuda.device_count)


def pytest_collectstart(collector):
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 4


NEEDS = {
    # test name -> (module it imports, package to install)
    "test_trainer_resumable_dataloader": ("streaming", "mosaicml-streaming"),
    "test_trainer_logging": ("wandb", "wandb"),
}


def _missing(module: str) -> bool:
    spec = importlib.util.find_spec(module)
    if spec is None:
        return True
    return module == "streaming" and "stubs" in str(spec.origin)  # run_upstream.sh's stand-in


def pytest_collection_modifyitems(config, items):
    for item in items:
        need = NEEDS.get(item.originalname if hasattr(item, "originalname") else item.name)
        if need and _missing(need[0]):
            item.add_marker(pytest.mark.skip(reason=f"environment: {need[1]} is not installed"))


def pytest_collection_finish(session):
    torch.cuda.is_available, torch.cuda.device_count = _orig


@pytest.fixture(autouse=True)
def clean_generated_files():
    yield
    for f in Path("./").resolve().glob("gencode*.py"):
        f.unlink()
