"""Searched plans with 2-D splits (the search chose the 2 x 2 mesh on a cluster where collectives cost
their bytes) train like the single-device model: a Llama, a GPT-2-style model with fused QKV (nanoGPT's
c_attn) and a mixture of experts (Mixtral), on 4 gloo ranks, SGD, parameters compared."""

from __future__ import annotations

from pathlib import Path

import pytest

from nnscaler.policies import Plan
from tests.mesh2d_policy import SLOW_LINK_CLUSTER
from tests.parity import ParityCase, run_parity_many

MODELS = ["llama", "gpt", "mixtral"]


def _plans(tmp_path: Path, ncases: int) -> list[Plan]:
    out = []
    for k in range(ncases):
        (path,) = sorted((tmp_path / "gen" / f"case{k}").rglob("plan.json"))
        out.append(Plan.from_json(path.read_text()))
    return out


@pytest.mark.slow
def test_searched_2d_plans_parity(tmp_path):
    cases = [
        ParityCase(m, "autodist", 4, {"pas_config": {"cluster": SLOW_LINK_CLUSTER}}, optimizer="sgd")
        for m in MODELS
    ]
    run_parity_many(cases, 4, tmp_path=tmp_path)
    for case, plan in zip(cases, _plans(tmp_path, len(cases))):
        assert plan.mesh == (2, 2), case.label
        both = [n for n, p in plan.nodes.items() if p.mesh_splits and all(i for i, _ in p.mesh_splits)]
        assert any(n.startswith("linear") for n in both), (case.label, both)
