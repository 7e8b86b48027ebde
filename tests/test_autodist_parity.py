"""Every plan autodist searches for the zoo trains like the single-device model (the parity harness,
real gloo ranks), on 2 and on 4 ranks: tensor-parallel shaped, pipelined, and with data-parallel
replicas.

The cost model was tuned while looking at llama, gpt and gpt2; the other zoo models were not used
to tune it. Each test starts its processes once and runs every model in turn (ParityCase).
"""

from __future__ import annotations

from pathlib import Path

from nnscaler.policies import Plan
from tests.parity import ParityCase, run_parity_many

# Megatron-style tensor parallelism is cheapest on this made-up cluster (see test_autodist_spmd.py).
TP_CLUSTER = {
    "device": {"name": "cpu", "fp32_tflops": 0.01, "mem_bw_gbs": 1e6, "kernel_overhead_us": 0},
    "devices_per_node": 8,
    "intra_node": {"bandwidth_gbs": 100, "latency_us": 10},
}
ZOO = ["mlp", "gpt", "llama", "gpt2", "mistral", "mixtral", "bert", "vit", "cnn", "userops"]
TRANSFORMERS = {"gpt", "llama", "gpt2", "mistral", "mixtral", "bert", "vit"}
PIVOTS = {"mlp": "Linear", "cnn": "Conv2d", "userops": "Linear"}
"""Models without a list of repeated layers: the module class whose instances start the stages."""


def _spmd(model: str, plan_ngpus: int, cluster=TP_CLUSTER) -> ParityCase:
    return ParityCase(model, "autodist", plan_ngpus, {"pas_config": {"cluster": cluster}})


def _pipelined(model: str, plan_ngpus: int) -> ParityCase:
    pas = {"cluster": TP_CLUSTER, "pipeline_nstages": 2, "pipeline_nmicros": 2}
    if model in PIVOTS:
        pas["pipeline_pivots"] = PIVOTS[model]
    return ParityCase(model, "autodist", plan_ngpus, {"use_end2end": True, "pas_config": pas}, nmicros=2)


def _plans(tmp_path: Path, ncases: int) -> list[Plan]:
    out = []
    for k in range(ncases):
        (path,) = sorted((tmp_path / "gen" / f"case{k}").rglob("plan.json"))
        out.append(Plan.from_json(path.read_text()))
    return out


def test_autodist_zoo_parity_on_two_ranks(tmp_path):
    """plan_ngpus 2: the searched SPMD split (Megatron-like for the transformers) and two stages."""
    cases = [_spmd(m, 2) for m in ZOO] + [_pipelined(m, 2) for m in ZOO]
    run_parity_many(cases, 2, tmp_path=tmp_path)
    plans = _plans(tmp_path, len(cases))
    for case, plan in zip(cases, plans):
        assert plan.policy == "autodist", case.label
        if case.nmicros:
            assert plan.pipeline is not None and plan.pipeline.nstages == 2, case.label
            assert plan.pipeline.nmicros == 2, case.label
        else:
            assert plan.pipeline is None and plan.tp_size == 2, case.label
            if case.model_name in TRANSFORMERS:
                assert plan.split_summary()["split"] >= 8, (case.label, plan.split_summary())


def test_autodist_zoo_parity_on_four_ranks(tmp_path):
    """4 ranks: a 4-way split; two stages of two devices each split by the search; and plans on two
    devices (the CPU cluster's costs) with two data-parallel replicas."""
    cases = (
        [_spmd(m, 4) for m in ZOO]
        + [_pipelined(m, 4) for m in ZOO]
        + [_spmd(m, 2, cluster="cpu_gloo") for m in ZOO]
    )
    run_parity_many(cases, 4, tmp_path=tmp_path)
    plans = _plans(tmp_path, len(cases))
    for case, plan in zip(cases, plans):
        if case.nmicros:
            assert plan.pipeline is not None and plan.pipeline.pp_size == 2 and plan.tp_size == 2, case.label
        else:
            assert plan.pipeline is None and plan.tp_size == case.plan_ngpus, case.label
    split_4 = [
        p.split_summary()["split"] for c, p in zip(cases, plans) if c.plan_ngpus == 4 and not c.nmicros
    ]
    assert sum(s >= 8 for s in split_4) >= len(TRANSFORMERS), split_4
