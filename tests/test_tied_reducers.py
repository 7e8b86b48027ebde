"""Tied-weight gradients under every reducer mode (issue 11): a 2-stage pipeline over 2 replicas
(runtime_ngpus 4; 4 replicas for zero_ngroups 2) with a tied embedding / head, trained with SGD (it sees the gradient's scale) and
compared, parameters included, with single-device gradient accumulation.

The hooks of the async reducer (and of ZeRO 2, always async) move each `.grad` into its bucket;
before the fix they took the tied weight's local gradient away before the pipeline summed it over
the stages, so the replicas averaged only their own stage's part. (The synchronous reducer, with
or without ZeRO 1, is covered by tests/test_pipeline_parity.py::test_pipeline_with_zero_and_sgd.)
"""

from __future__ import annotations

import pytest

from tests.parity import run_parity

NMICROS = 2

CASES = {
    # id: (runtime_ngpus, reducer config)
    "async-dp2": (4, {"use_async_reducer": True}),
    "zero1-async-dp2": (4, {"use_zero": True, "use_async_reducer": True}),
    "zero2-dp2": (4, {"use_zero": True, "zero_stage": 2}),
    # 4 replicas in 2 ZeRO groups of 2 (with 2 replicas a ZeRO group would be one rank, i.e. no ZeRO):
    # reduce-scatter in the ZeRO group, then all-reduce of the slice over the cross group
    "zero2-ngroups2-dp4": (8, {"use_zero": True, "zero_stage": 2, "zero_ngroups": 2}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tied_weight_parity_pp2(case, tmp_path):
    runtime_ngpus, reducer = CASES[case]
    run_parity(
        "tests.models_tied:build_embedding",
        "pp",
        2,
        runtime_ngpus,
        steps=2,
        tmp_path=tmp_path,
        nmicros=NMICROS,
        optimizer="sgd",
        atol=1e-6,
        config_kwargs={
            "use_end2end": True,
            "pas_config": {"pipeline_nmicros": NMICROS, "pipeline_nstages": 2},
            **reducer,
        },
    )
