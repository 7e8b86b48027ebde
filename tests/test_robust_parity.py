"""Robust gradient aggregation with no replica suspected (`byzantine_b=0`) is the mean: median,
trimmed_mean and zeno train exactly as single-device training does (the parity harness, 4 gloo ranks,
dp only and tp 2 x dp 2, with and without ZeRO)."""

from __future__ import annotations

from tests.parity import ParityCase, run_parity_many


def test_robust_modes_with_b0_match_the_mean(tmp_path) -> None:
    cases = [
        ParityCase("mlp", "dp", 1, {"grad_aggregation": "median", "byzantine_b": 0}),
        ParityCase("mlp", "dp", 1, {"grad_aggregation": "trimmed_mean", "byzantine_b": 0, "use_zero": True}),
        ParityCase(
            "mlp", "dp", 1, {"grad_aggregation": "zeno", "byzantine_b": 0, "use_zero": True, "zero_stage": 2}
        ),
        ParityCase("mlp", "tp", 2, {"grad_aggregation": "median", "byzantine_b": 0}, optimizer="sgd"),
    ]
    results = run_parity_many(cases, 4, tmp_path=tmp_path)
    assert all(r["reduced"] for case in results for r in case), "every case reduced its gradients"
