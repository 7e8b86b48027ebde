"""The schedule autodist picks runs and trains like one device: pipelines whose schedule the search
chose (pipeline_scheduler 'auto') on 2 gloo ranks, SGD, every parameter compared; the plan records the
schedule the search scored best (a zero-bubble one on these models, as the cost model predicts)."""

from __future__ import annotations

from pathlib import Path

from nnscaler import ComputeConfig
from nnscaler.graph.capture import capture
from nnscaler.policies import Plan, make_plan
from tests import zoo
from tests.parity import ParityCase, run_parity_many
from tests.test_autodist_parity import TP_CLUSTER

ZERO_BUBBLE = ("zb_h1", "zbv", "dualpipev")


def _case(model: str, nstages: int) -> ParityCase:
    pas = {"cluster": TP_CLUSTER, "pipeline_nstages": nstages, "pipeline_nmicros": 4}
    return ParityCase(
        model, "autodist", 2, {"use_end2end": True, "pas_config": pas}, nmicros=4, optimizer="sgd"
    )


def test_autodist_chosen_schedules_match_single_device(tmp_path: Path):
    cases = [_case("llama_deep", 4), _case("gpt_deep", 2)]
    expected = []
    for case in cases:  # what the search picks for these inputs, planned here on one process
        model, make_batch = zoo.build(case.model_name)
        graph = capture(model, make_batch(12345, 4))
        cfg = ComputeConfig(2, 2, **case.config_kwargs)
        expected.append(make_plan(graph, "autodist", cfg).pipeline.scheduler)
    assert all(s in ZERO_BUBBLE for s in expected), expected
    run_parity_many(cases, 2, tmp_path=tmp_path, steps=2)
    for k, (case, scheduler) in enumerate(zip(cases, expected)):
        (path,) = sorted((tmp_path / "gen" / f"case{k}").rglob("plan.json"))
        plan = Plan.from_json(path.read_text())
        nstages = case.config_kwargs["pas_config"]["pipeline_nstages"]
        assert (plan.pipeline.scheduler, plan.pipeline.nstages) == (scheduler, nstages), case.label
