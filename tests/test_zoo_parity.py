"""Model coverage (issue 3): the transformers zoo and a CNN train in parallel exactly as on one device."""

from __future__ import annotations

import pytest

from tests.parity import run_parity

ZOO3 = ["mistral", "bert", "mixtral", "vit", "cnn"]


@pytest.mark.parametrize(
    "policy,plan_ngpus,runtime_ngpus", [("dp", 1, 2), ("tp", 2, 2)], ids=["dp-1-2", "tp-2-2"]
)
@pytest.mark.parametrize("model_name", ZOO3)
def test_zoo_parity(model_name, policy, plan_ngpus, runtime_ngpus, tmp_path):
    run_parity(model_name, policy, plan_ngpus, runtime_ngpus, tmp_path=tmp_path)


@pytest.mark.parametrize("model_name", ["llama", "mixtral"])
def test_zoo_parity_tp4(model_name, tmp_path):
    """tp over 4 devices with 2 key/value heads: heads do not divide, the plan falls back where needed."""
    run_parity(model_name, "tp", 4, 4, tmp_path=tmp_path)
