"""Zero-bubble schedules with parallelism inside the stages (issue 44), 4 gloo ranks, SGD parity:
tensor parallelism in a V (hybrid, 2 device groups x tp 2, zbv), context parallelism (cp 2 zigzag
ring attention, zb_h1) and expert parallelism (Mixtral, ep 2, zb_h1). Their collectives' backwards lie
on the stage's input path, so B runs them, in the same order on every rank of a stage."""

from __future__ import annotations

import pytest

from tests.parity import ParityCase, run_parity_many


def _hybrid(model: str, scheduler: str, **pas) -> ParityCase:
    pas = {"pp_size": 2, "pipeline_nmicros": 2, "pipeline_scheduler": scheduler, **pas}
    return ParityCase(
        model, "hybrid", 4, {"pas_config": pas, "use_end2end": True}, nmicros=2, optimizer="sgd"
    )


@pytest.mark.timeout(600)
def test_zero_bubble_with_tp_cp_and_ep_inside_stages(tmp_path):
    run_parity_many(
        [
            _hybrid("llama_deep", "zbv", pipeline_nstages=4),
            _hybrid("tests.models_long:build_llama_long", "zb_h1", cp_size=2, cp_kind="zigzag"),
            _hybrid("tests.models_moe:build_mixtral", "zb_h1", ep_size=2),
        ],
        4,
        tmp_path=tmp_path,
        steps=1,
        timeout=550,
    )
