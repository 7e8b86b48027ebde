"""Plans searched by autodist train like the single-device model (the parity harness, real gloo ranks).

The cost model was tuned while looking at llama, gpt and gpt2; the models here (mistral, bert) were
not used to tune it.
"""

from __future__ import annotations

import pytest

from nnscaler.policies import Plan
from tests.parity import run_parity

# Megatron-style tensor parallelism is cheapest on this made-up cluster (see test_autodist_spmd.py).
TP_CLUSTER = {
    "device": {"name": "cpu", "fp32_tflops": 0.01, "mem_bw_gbs": 1e6, "kernel_overhead_us": 0},
    "devices_per_node": 8,
    "intra_node": {"bandwidth_gbs": 100, "latency_us": 10},
}


@pytest.mark.parametrize("model_name,plan_ngpus,runtime_ngpus", [("mistral", 2, 2), ("bert", 2, 4)])
def test_autodist_tensor_parallel_parity(model_name, plan_ngpus, runtime_ngpus, tmp_path):
    results = run_parity(
        model_name,
        "autodist",
        plan_ngpus,
        runtime_ngpus,
        steps=2,
        tmp_path=tmp_path,
        config_kwargs={"pas_config": {"cluster": TP_CLUSTER}},
    )
    assert results
    plan = _saved_plan(tmp_path)
    assert plan.policy == "autodist" and plan.split_summary()["split"] >= 8, plan.split_summary()


def _saved_plan(tmp_path) -> Plan:
    (path,) = sorted((tmp_path / "gen").rglob("plan.json"))
    return Plan.from_json(path.read_text())


def test_autodist_pipeline_parity(tmp_path):
    """Two pipeline stages searched on the stage boundaries (pipeline_nstages fixes the count)."""
    run_parity(
        "mistral",
        "autodist",
        2,
        2,
        steps=2,
        tmp_path=tmp_path,
        nmicros=2,
        config_kwargs={
            "use_end2end": True,
            "pas_config": {"cluster": "cpu_gloo", "pipeline_nstages": 2, "pipeline_nmicros": 2},
        },
    )
    plan = _saved_plan(tmp_path)
    assert plan.pipeline is not None and plan.pipeline.nstages == 2 and plan.pipeline.nmicros == 2


def test_autodist_pipeline_with_tensor_parallel_stages_parity(tmp_path):
    """4 ranks: two stages of two devices, each stage split by the search (Megatron-style here)."""
    run_parity(
        "llama",
        "autodist",
        4,
        4,
        steps=2,
        tmp_path=tmp_path,
        nmicros=2,
        config_kwargs={
            "use_end2end": True,
            "pas_config": {"cluster": TP_CLUSTER, "pipeline_nstages": 2, "pipeline_nmicros": 2},
        },
    )
    plan = _saved_plan(tmp_path)
    assert plan.pipeline is not None and plan.pipeline.pp_size == 2 and plan.tp_size == 2
    assert plan.split_summary()["split"] >= 8, plan.split_summary()
