# REPLACEMENT of nnScaler 0.8's tests/conftest.py: no autodist C++ build; its tests' GPU-count skip
# conditions are evaluated with 4 "devices" (their launcher here runs ranks as CPU processes with
# gloo), so tests needing 8 ranks stay skipped. CUDA is reported absent again once collected.
from pathlib import Path

import pytest
import torch

_orig = (torch.cuda.is_available, torch.cuda.device_count)


def pytest_collectstart(collector):
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 4


def pytest_collection_finish(session):
    torch.cuda.is_available, torch.cuda.device_count = _orig


@pytest.fixture(autouse=True)
def clean_generated_files():
    yield
    for f in Path("./").resolve().glob("gencode*.py"):
        f.unlink()
