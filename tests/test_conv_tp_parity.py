"""A conv net with biased convolutions (tests/zoo_convnet.py) trains exactly as on one device under tp
(2, 2), data (2, 2) and autodist (2, 2), SGD, every parameter compared. Under tp the second conv is
row-parallel although it has a bias (the local conv runs without it, the partial sums are all-reduced,
then bias.view(-1, 1, 1) is added once), so a rank keeps at most 60% of the parameters; the same on a
2-D mesh (batch x tp, tests/mesh2d_policy.py).
"""

from __future__ import annotations

from nnscaler.policies.plan import Plan
from tests.parity import ParityCase, run_parity_many

MODEL = "tests.zoo_convnet:build_conv_net"


def test_biased_conv_pair_is_column_then_row_parallel(tmp_path):
    cases = [
        ParityCase(MODEL, "tp", 2, optimizer="sgd"),
        ParityCase(MODEL, "data", 2, optimizer="sgd"),
        ParityCase(MODEL, "autodist", 2, optimizer="sgd"),
    ]
    results = run_parity_many(cases, 2, tmp_path=tmp_path, timeout=280)
    tp = results[0]
    assert all(r["local_param_fraction"] <= 0.6 for r in tp), (
        f"{cases[0].label}: a rank keeps {max(r['local_param_fraction'] for r in tp):.0%} of the "
        "parameters: the biased convs were not split column -> row parallel"
    )
    (path,) = sorted((tmp_path / "gen" / "case0").rglob("plan.json"))
    plan = Plan.from_json(path.read_text())
    assert plan.node("conv2d").split == "o", plan.node("conv2d").describe()
    assert plan.node("conv2d_1").split == "c", (
        f"the biased conv2 is not row-parallel: {plan.node('conv2d_1').describe()}"
    )


def test_biased_conv_row_parallel_on_a_2d_mesh(tmp_path):
    """Mesh (2, 2): the batch over axis 0, tp over axis 1; the biased conv2 is split on both (n, c): its
    partial sums are all-reduced over axis 1 only, then the bias is added."""
    case = ParityCase(MODEL, "tests.mesh2d_policy.data_x_tp", 4, optimizer="sgd")
    run_parity_many([case], 4, tmp_path=tmp_path, timeout=280)
    (path,) = sorted((tmp_path / "gen" / "case0").rglob("plan.json"))
    plan = Plan.from_json(path.read_text())
    assert plan.node("conv2d_1").describe() == "(n, c)", plan.node("conv2d_1").describe()
