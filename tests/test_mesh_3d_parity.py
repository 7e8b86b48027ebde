"""A plan on a pinned 2 x 2 x 2 mesh (the batch-like dim over axis 0, a linear's n and k over axes 1
and 2) trains like the single-device model: the GPT-2-style zoo model on 8 gloo ranks, SGD,
parameters compared."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.mesh2d_policy import SLOW_LINK_CLUSTER
from tests.parity import run_parity


def _plan_of(tmp_path: Path) -> dict:
    (path,) = list((tmp_path / "gen").rglob("plan.json"))
    return json.loads(path.read_text())


@pytest.mark.slow
def test_pinned_three_axis_mesh_parity(tmp_path):
    pas = {"cluster": SLOW_LINK_CLUSTER, "tp_mesh": [2, 2, 2]}
    run_parity(
        "gpt",
        "autodist",
        8,
        8,
        steps=2,
        tmp_path=tmp_path,
        optimizer="sgd",
        config_kwargs={"pas_config": pas},
    )
    plan = _plan_of(tmp_path)
    assert plan["mesh"] == [2, 2, 2]
    three = [
        n
        for n, p in plan["nodes"].items()
        if len(p.get("mesh_splits", [])) == 3 and all(ident for ident, _ in p["mesh_splits"])
    ]
    assert any(n.startswith("linear") for n in three), plan["nodes"]
