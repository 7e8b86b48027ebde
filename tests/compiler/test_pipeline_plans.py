"""Pipeline planning without processes: schedules, staging, relays, errors and the generated schedule."""

from __future__ import annotations

import ast
import re

import pytest
import torch
from torch import nn

from nnscaler import ComputeConfig
from nnscaler.codegen import generate_code
from nnscaler.errors import PlanError
from nnscaler.graph.capture import capture
from nnscaler.graph.ir import cut_graph
from nnscaler.parallel.compile import compile_module
from nnscaler.partition import apply_pipeline
from nnscaler.policies import Plan, make_plan
from nnscaler.policies.schedules import group_actions, simulate, theoretical_bubble
from nnscaler.policies.stage_balance import node_cost
from nnscaler.runtime.pipeline import split_micro_batches
from tests import zoo


@pytest.fixture(scope="module")
def deep_graphs():
    out = {}
    for name in ("gpt_deep", "llama_deep"):
        model, make_batch = zoo.build(name)
        out[name] = capture(model, make_batch(1, 2))
    return out


def _cfg(plan: int, runtime: int | None = None, **pas) -> ComputeConfig:
    return ComputeConfig(plan, runtime or plan, use_end2end=True, pas_config={"pipeline_nmicros": 4, **pas})


# ---- schedules ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheduler", ["gpipe", "1f1b"])
@pytest.mark.parametrize("nstages", [2, 3, 4])
@pytest.mark.parametrize("nmicros", [1, 2, 3, 4, 7, 8])
def test_schedules_run_every_pass_once_without_deadlock(scheduler, nstages, nmicros):
    timing = simulate(scheduler, nstages, nstages, nmicros)
    assert timing.makespan > 0
    for g in range(nstages):
        actions = group_actions(scheduler, nstages, nstages, nmicros, g)
        in_flight = peak = 0
        for a in actions:
            in_flight += 1 if a.kind == "F" else -1
            peak = max(peak, in_flight)
        limit = nmicros if scheduler == "gpipe" else min(nstages - g, nmicros)
        assert peak == limit, f"{scheduler} stage {g}: {peak} micro-batches in flight, expected {limit}"


@pytest.mark.parametrize(
    "pp,chunks,nmicros", [(2, 2, 2), (2, 2, 4), (4, 2, 4), (4, 2, 8), (2, 3, 6), (4, 4, 8)]
)
def test_interleaved_schedule_runs_and_has_a_smaller_bubble(pp, chunks, nmicros):
    timing = simulate("1f1b_interleaved", pp * chunks, pp, nmicros)
    plain = simulate("1f1b", pp, pp, nmicros)
    assert max(timing.idle_fraction) < max(plain.idle_fraction)
    assert max(timing.idle_fraction) == pytest.approx(
        theoretical_bubble("1f1b_interleaved", pp * chunks, pp, nmicros)
    )


def test_simulated_bubble_matches_the_textbook_formula():
    for scheduler in ("gpipe", "1f1b"):
        for m in (4, 8, 16):
            t = simulate(scheduler, 4, 4, m)
            assert t.idle_fraction == pytest.approx([3 / (m + 3)] * 4)


def test_interleaved_needs_micro_batches_in_rounds_of_the_groups():
    with pytest.raises(PlanError, match="multiple of the number of pipeline device groups"):
        group_actions("1f1b_interleaved", 8, 4, 6, 0)


# ---- staging ---------------------------------------------------------------------------------------
def test_stages_start_at_layers_and_balance_cost(deep_graphs):
    graph = deep_graphs["gpt_deep"]
    plan = make_plan(graph, "pp", _cfg(4))
    assert plan.pipeline.pivots == ("Block",)
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    starts = [index[s] for s in plan.pipeline.starts]
    assert starts[0] == 0
    for i in starts[1:]:  # every later stage starts with a transformer block
        assert re.fullmatch(r"transformer\.h\.\d+(\..*)?", graph.nodes[i].module_path)
    costs = [sum(node_cost(n, graph) for n in p.graph.nodes) for p in cut_graph(graph, starts)]
    block = sum(node_cost(n, graph) for n in graph.nodes if n.module_path.startswith("transformer.h.0"))
    assert max(costs) - min(costs) <= 1.5 * block, f"unbalanced stages: {costs} (one block costs {block})"


def test_explicit_stage_starts(deep_graphs):
    graph = deep_graphs["gpt_deep"]
    plan = make_plan(graph, "pp", _cfg(2, pipeline_stages=["transformer.h.6"]))
    second = next(n for n in graph.nodes if n.name == plan.pipeline.starts[1])
    assert second.module_path.startswith("transformer.h.6")


def test_activations_that_skip_a_stage_are_relayed(deep_graphs):
    graph = deep_graphs["llama_deep"]
    plan = make_plan(graph, "pp", _cfg(4))
    program = apply_pipeline(graph, plan)
    made_in_0 = {o for n in program.stages[0].program.statements for o in n.outputs}
    relayed = [
        name
        for name in program.stages[2].received
        if name in made_in_0 and name in program.stages[1].received
    ]
    assert relayed, "stage 2 should receive values computed in stage 0 (rotary cos/sin, mask) through stage 1"
    sent_by_1 = {r.name for r in program.stages[1].program.outputs}
    assert set(program.stages[2].received) <= sent_by_1


def test_tied_embedding_is_held_by_the_first_and_last_stage(deep_graphs):
    graph = deep_graphs["gpt_deep"]
    program = apply_pipeline(graph, make_plan(graph, "pp", _cfg(4)))
    assert program.param_stages["transformer_wte_weight"] == [0, 3]


def test_plan_with_pipeline_round_trips_through_json(deep_graphs):
    plan = make_plan(deep_graphs["gpt_deep"], "pp", _cfg(4, pipeline_scheduler="1f1b_interleaved"))
    assert plan.pipeline.nstages == 8 and plan.pipeline.pp_size == 4
    assert Plan.from_json(plan.to_json()) == plan


# ---- bad input --------------------------------------------------------------------------------------
def test_more_stages_than_pivots(zoo_graphs):
    graph = zoo_graphs["gpt"][0]  # two transformer blocks
    with pytest.raises(PlanError, match="places a stage can start"):
        make_plan(graph, "pp", _cfg(4, pipeline_pivots="Block"))


def test_more_stages_than_layers_cut_inside_them(zoo_graphs):
    """Without named pivots, 4 stages on two blocks start inside the blocks (stage_balance.py's finer
    levels), every stage holding weights and work, instead of refusing."""
    graph = zoo_graphs["gpt"][0]
    plan = make_plan(graph, "pp", _cfg(4))
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    starts = [index[s] for s in plan.pipeline.starts]
    for piece in cut_graph(graph, starts):
        assert piece.params, f"stage {piece.index} holds no weights"
        assert sum(node_cost(n, graph) for n in piece.graph.nodes) > 0


def test_pipeline_needs_end2end(zoo_graphs):
    cfg = ComputeConfig(2, 2, pas_config={"pipeline_nmicros": 4})
    with pytest.raises(PlanError, match="use_end2end=True"):
        make_plan(zoo_graphs["gpt"][0], "pp", cfg)


def test_pipeline_needs_nmicros(zoo_graphs):
    cfg = ComputeConfig(2, 2, use_end2end=True)
    with pytest.raises(PlanError, match="pipeline_nmicros"):
        make_plan(zoo_graphs["gpt"][0], "pp", cfg)


def test_zero3_is_refused_with_pipelines(zoo_graphs):
    cfg = ComputeConfig(
        2, 4, use_end2end=True, use_zero=True, zero_stage=3, pas_config={"pipeline_nmicros": 2}
    )
    with pytest.raises(PlanError, match="ZeRO stage 3"):
        make_plan(zoo_graphs["gpt"][0], "pp", cfg)


def test_unknown_scheduler(zoo_graphs):
    with pytest.raises(PlanError, match="pipeline_scheduler"):
        make_plan(zoo_graphs["gpt"][0], "pp", _cfg(2, pipeline_scheduler="zb"))


def test_virtual_stages_need_the_interleaved_schedule(deep_graphs):
    with pytest.raises(PlanError, match="1f1b_interleaved"):
        make_plan(deep_graphs["gpt_deep"], "pp", _cfg(2, pipeline_nstages=4))


class _Logits(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x  # not a loss


def test_loss_must_be_a_scalar():
    graph = capture(_Logits(), {"x": torch.randn(4, 8)})
    with pytest.raises(PlanError, match=r"first output .* shape \[4, 8\]"):
        make_plan(graph, "pp", _cfg(2))


def test_micro_batches_must_divide_the_batch():
    batch = {"idx": torch.zeros(10, 16, dtype=torch.long), "targets": torch.zeros(10, 16, dtype=torch.long)}
    with pytest.raises(ValueError, match="batch of 10 samples cannot be split into pipeline_nmicros=4"):
        split_micro_batches(batch, 4)
    parts = split_micro_batches(batch, 5)
    assert len(parts) == 5 and parts[0]["idx"].shape == (2, 16)


# ---- generated code ----------------------------------------------------------------------------------
def _order(source: str) -> list[str]:
    body = source[source.index("def _train_step") : source.index("def _infer_step")]
    return [
        f"{k[0].upper()}{s}.{m}"
        for k, s, m in re.findall(r"# (forward|backward): stage (\d+), micro-batch (\d+)", body)
    ]


def test_generated_train_step_follows_1f1b(tmp_path):
    model, make_batch = zoo.build("gpt_deep")
    cfg = ComputeConfig(4, 4, use_end2end=True, pas_config={"pipeline_nmicros": 4})
    compile_module(model, make_batch(1, 2), "pp", cfg, tmp_path, "test")
    rank0 = (tmp_path / "gencode0.py").read_text()
    ast.parse(rank0)
    assert _order(rank0) == ["F0.0", "F0.1", "F0.2", "F0.3", "B0.0", "B0.1", "B0.2", "B0.3"]
    rank1 = (tmp_path / "gencode1.py").read_text()
    assert _order(rank1) == ["F1.0", "F1.1", "F1.2", "B1.0", "F1.3", "B1.1", "B1.2", "B1.3"]
    assert "def stage1(self, mb, " in rank1 and "def stage0(" not in rank1
    assert "pipe.recv_forward(1, 0, src=0)" in rank1 and "dst=2" in rank1
    rank3 = (tmp_path / "gencode3.py").read_text()
    assert _order(rank3)[:2] == ["F3.0", "B3.0"]
    assert 'self.add_tied("transformer_wte_weight", [0, 3])' in rank3


def test_generated_interleaved_rank_runs_two_stages(deep_graphs):
    graph = deep_graphs["gpt_deep"]
    cfg = _cfg(4, pipeline_scheduler="1f1b_interleaved")
    program = apply_pipeline(graph, make_plan(graph, "pp", cfg))
    shapes = {k: v.meta.shape for k, v in graph.values.items() if v.meta is not None}
    source = generate_code(program, 0, cfg, "GPT", "pp", shapes, "test")
    assert "def stage0(" in source and "def stage4(" in source and "def stage1(" not in source
    order = _order(source)
    assert len(order) == 16 and order[0] == "F0.0"
    assert "pipe.recv_forward(4, 0, src=3)" in source  # stage 3 on rank 3 feeds virtual stage 4
