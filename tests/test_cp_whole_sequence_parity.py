"""Context parallelism on models where an op before the attention needs the whole sequence: a
state-space scan (tests/zoo_unequal.py) and windows rolled over an image (tests/zoo_shifted_windows.py).
The attention still splits by sequence (q, k and v sliced locally), every kind reproduces one device,
and the plan says where the split starts."""

from __future__ import annotations

from nnscaler import ComputeConfig
from nnscaler.graph.capture import capture
from nnscaler.policies import make_plan
from nnscaler.policies.context_parallel import attention_nodes
from tests.parity import ParityCase, run_parity_many
from tests.zoo_unequal import build_unequal

MODELS = ("tests.zoo_unequal:build_unequal", "tests.zoo_shifted_windows:build_swin")


def test_attention_after_a_scan_is_split_at_its_inputs():
    model, make_batch = build_unequal(0)
    graph = capture(model, make_batch(0, 4), both_modes=False)
    plan = make_plan(graph, "tp", ComputeConfig(4, 4, pas_config={"cp_size": 2, "cp_kind": "zigzag"}))
    attention = attention_nodes(graph)
    assert attention
    for node in attention:
        splits = plan.node(node.name).mesh_splits
        assert splits[0][0] == "s", (node.name, splits)  # the sequence on the cp axis
        assert "sequence split at the attention" in plan.node(node.name).note


def test_models_with_whole_sequence_ops_match_one_device_under_cp(tmp_path):
    cases = [
        ParityCase(model, "tp", 2, {"pas_config": {"cp_size": 2, "cp_kind": kind}}, optimizer="sgd")
        for model in MODELS
        for kind in ("zigzag", "ulysses")
    ]
    run_parity_many(cases, 2, tmp_path=tmp_path, timeout=280)
