"""Parallel training matches single-device training for every zoo model under every basic plan."""

from __future__ import annotations

import pytest

from tests.parity import run_parity
from tests.zoo import PARITY_MODELS

# (policy, plan_ngpus, runtime_ngpus)
PLANS = [
    ("dp", 1, 2),  # pure data parallel
    ("data", 2, 2),  # batch split inside one plan
    ("tp", 2, 2),  # tensor parallel
    ("tp", 2, 4),  # tensor parallel x 2 data-parallel replicas
]
PLAN_IDS = [f"{p}-{a}-{b}" for p, a, b in PLANS]


@pytest.mark.parametrize("policy,plan_ngpus,runtime_ngpus", PLANS, ids=PLAN_IDS)
@pytest.mark.parametrize("model_name", PARITY_MODELS)
def test_parity(model_name: str, policy: str, plan_ngpus: int, runtime_ngpus: int, tmp_path) -> None:
    run_parity(model_name, policy, plan_ngpus, runtime_ngpus, steps=3, tmp_path=tmp_path)


@pytest.mark.parametrize("policy,plan_ngpus,runtime_ngpus", PLANS, ids=PLAN_IDS)
@pytest.mark.parametrize("model_name", ["mlp", "gpt"])
def test_parity_gradient_scale(
    model_name: str, policy: str, plan_ngpus: int, runtime_ngpus: int, tmp_path
) -> None:
    """With SGD, a gradient summed where it should be averaged (or counted twice) changes the weights."""
    run_parity(model_name, policy, plan_ngpus, runtime_ngpus, steps=3, optimizer="sgd", tmp_path=tmp_path)
