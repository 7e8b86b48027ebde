"""Zero-bubble schedules with data-parallel replicas (issue 44): 2 replicas of a 2-device plan on 4 gloo
ranks, ZeRO 1 and 2, SGD parity; the reducer's overlap still works: the gradient hooks fire in the W
passes (autograd's AccumulateGrad), so the last micro-batch's W launches bucket reductions."""

from __future__ import annotations

from tests.parity import run_parity_many
from tests.test_zero_bubble_parity import zb_case


def test_zero_bubble_with_zero_and_overlapping_reducer(tmp_path):
    overlap = {"reducer_bucket_cap_mb": 0.05}
    results = run_parity_many(
        [
            zb_case("gpt_deep", "zbv", 4, use_zero=True, zero_stage=1, **overlap),
            zb_case("gpt", "zb_h1", 4, use_zero=True, zero_stage=2, **overlap),
        ],
        4,
        tmp_path=tmp_path,
        steps=1,
    )
    for case in results:
        for r in case:
            assert min(r["launched_in_backward"]) > 0, (
                f"rank {r['rank']}: no bucket reduction launched during backward: {r['launched_in_backward']}"
            )
