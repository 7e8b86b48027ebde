"""Zero-bubble pipeline schedules (issue 44) against single-device training, 4 micro-batches: zb_h1 and
zbv on 2 gloo ranks (zbv: a V of 2 ranks x 2 stages), SGD, every parameter compared. The GPT ties its
embedding and head: across the 2 ranks in zb_h1, on one rank (stages 0 and 3) in the V."""

from __future__ import annotations

from tests.parity import ParityCase, run_parity_many


def zb_case(model: str, scheduler: str, nmicros: int, **cfg) -> ParityCase:
    """A 2-device `pp` plan under `scheduler`, SGD; `cfg`: more ComputeConfig fields, `pas`: more pas_config."""
    pas = {"pipeline_nmicros": nmicros, "pipeline_scheduler": scheduler, **cfg.pop("pas", {})}
    return ParityCase(
        model,
        "pp",
        2,
        config_kwargs={"use_end2end": True, "pas_config": pas, **cfg},
        nmicros=nmicros,
        optimizer="sgd",
    )


def test_zb_h1_and_zbv_parity_4_micro_batches(tmp_path):
    run_parity_many(
        [zb_case("gpt", "zb_h1", 4), zb_case("gpt_deep", "zbv", 4), zb_case("llama_deep", "zbv", 4)],
        2,
        tmp_path=tmp_path,
        steps=2,
    )
