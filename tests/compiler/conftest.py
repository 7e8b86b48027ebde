"""Traced zoo graphs shared by the compiler tests (tracing is the slow part, so do it once)."""

from __future__ import annotations

import pytest

from nnscaler.graph.capture import capture
from tests import zoo

ZOO = ["mlp", "gpt", "llama", "gpt2"]


@pytest.fixture(scope="session")
def zoo_graphs():
    graphs = {}
    for name in ZOO:
        model, make_batch = zoo.build(name)
        graphs[name] = (capture(model, make_batch(12345, 4)), model, make_batch)
    return graphs
