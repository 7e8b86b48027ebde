"""Tied-weight gradients under every reducer mode (issue 11): a 2-stage pipeline over 2 replicas
(runtime_ngpus 4) with a tied embedding / head, trained with SGD (it sees the gradient's scale) and
compared, parameters included, with single-device gradient accumulation.

The hooks of the async reducer (and of ZeRO 2, always async) move each `.grad` into its bucket;
before the fix they took the tied weight's local gradient away before the pipeline summed it over
the stages, so the replicas averaged only their own stage's part.
"""

from __future__ import annotations

import pytest

from tests.parity import run_parity

NMICROS = 2

CASES = {
    "async": {"use_async_reducer": True},
    "zero1-async": {"use_zero": True, "use_async_reducer": True},
    "zero2": {"use_zero": True, "zero_stage": 2},
}


@pytest.mark.parametrize("case", list(CASES))
def test_tied_weight_parity_pp2_dp2(case, tmp_path):
    run_parity(
        "tests.models_tied:build_embedding",
        "pp",
        2,
        4,
        steps=2,
        tmp_path=tmp_path,
        nmicros=NMICROS,
        optimizer="sgd",
        atol=1e-6,
        config_kwargs={
            "use_end2end": True,
            "pas_config": {"pipeline_nmicros": NMICROS, "pipeline_nstages": 2},
            **CASES[case],
        },
    )
