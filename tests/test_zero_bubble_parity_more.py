"""Zero-bubble schedules against single-device training (issue 44), continued: 8 micro-batches,
dualpipev (its overlapped forward/backward pairs and full backwards beside split ones), and recomputed
blocks (the W pass walks a graph whose checkpointed regions run their forward again)."""

from __future__ import annotations

from tests.parity import run_parity_many
from tests.test_zero_bubble_parity import zb_case


def test_zero_bubble_parity_8_micro_batches_dualpipev_and_recompute(tmp_path):
    run_parity_many(
        [
            zb_case("gpt", "zb_h1", 8),
            zb_case("gpt_deep", "zbv", 8),
            zb_case("gpt_deep", "dualpipev", 8),
            zb_case("llama_deep", "dualpipev", 4),
            zb_case("gpt_deep", "zbv", 4, pas={"recompute_modules": "Block"}),
        ],
        2,
        tmp_path=tmp_path,
        steps=1,
    )
