"""A custom policy that stages the model itself and attaches the schedule with nnScaler's
`ComputeConfig.apply_pipeline_scheduler` trains like the single-device model."""

from __future__ import annotations

import pytest

from nnscaler import ComputeConfig
from nnscaler.errors import ConfigError
from nnscaler.graph.ir import Graph
from nnscaler.policies import PipelinePlan, Plan
from nnscaler.policies.staging import pivot_starts
from tests.parity import run_parity


def two_stage_gpipe(graph: Graph, cfg: ComputeConfig) -> Plan:
    """Stage 1 starts at the second transformer block; every op replicated inside its stage."""
    blocks = pivot_starts(graph, ("Block",))
    starts = (graph.nodes[0].name, graph.nodes[blocks[1][0]].name)
    staged = Plan("two_stage_gpipe", cfg.plan_ngpus, pipeline=PipelinePlan(starts, pp_size=2, nmicros=1))
    return cfg.apply_pipeline_scheduler(staged, 2, cfg.pas_config["nmicros"], "gpipe")


def test_custom_staged_policy_parity(tmp_path):
    run_parity(
        "gpt",
        two_stage_gpipe,
        2,
        2,
        steps=2,
        tmp_path=tmp_path,
        nmicros=3,
        config_kwargs={"use_end2end": True, "pas_config": {"nmicros": 3}},
    )


def test_apply_pipeline_scheduler_errors_name_the_fix():
    plan = Plan("p", 2, pipeline=PipelinePlan(("a", "b"), pp_size=2, nmicros=1))
    with pytest.raises(ConfigError, match="use_end2end=True"):
        ComputeConfig(2, 2).apply_pipeline_scheduler(plan, 2, 4)
    cfg = ComputeConfig(2, 2, use_end2end=True)
    with pytest.raises(ConfigError, match="no stages"):
        cfg.apply_pipeline_scheduler(Plan("p", 2), 2, 4)
    with pytest.raises(ConfigError, match="nstages=3 but the plan has 2 stages"):
        cfg.apply_pipeline_scheduler(plan, 3, 4)
    out = cfg.apply_pipeline_scheduler(plan, 2, 4, "1f1b")
    assert (out.pipeline.nmicros, out.pipeline.scheduler, plan.pipeline.nmicros) == (4, "1f1b", 1)
