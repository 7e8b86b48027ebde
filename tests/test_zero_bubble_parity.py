"""Zero-bubble pipeline schedules (issue 44) against single-device training: zb_h1, zbv and dualpipev on
2 gloo ranks (a V: 2 ranks x 2 stages), SGD, every parameter compared; 4 and 8 micro-batches, the
tied embedding of the GPT (its two stages on one rank in a V, on two ranks in zb_h1), ZeRO 1 and 2
with the overlapping reducer, recomputed blocks."""

from __future__ import annotations

from tests.parity import ParityCase, run_parity_many


def _case(model: str, scheduler: str, nmicros: int, **extra) -> ParityCase:
    cfg = extra.pop("cfg", {})
    pas = {"pipeline_nmicros": nmicros, "pipeline_scheduler": scheduler, **extra}
    return ParityCase(
        model,
        "pp",
        2,
        config_kwargs={"use_end2end": True, "pas_config": pas, **cfg},
        nmicros=nmicros,
        optimizer="sgd",
    )


def test_zero_bubble_parity_4_micro_batches(tmp_path):
    run_parity_many(
        [
            _case("gpt", "zb_h1", 4),
            _case("gpt_deep", "zbv", 4),
            _case("llama_deep", "zbv", 4),
            _case("gpt_deep", "dualpipev", 4),
        ],
        2,
        tmp_path=tmp_path,
        steps=2,
    )
