"""Measured op costs: the profiler's database overrides the analytic compute time where present."""

from __future__ import annotations

from nnscaler import ComputeConfig
from nnscaler.policies import make_plan
from nnscaler.policies.autodist import planner_setup, solve_spmd
from nnscaler.policies.autodist.choices import node_choices, op_key
from nnscaler.policies.autodist.memory import MemoryModel
from nnscaler.policies.autodist.profiler import ProfileDB, profile_graph
from nnscaler.policies.autodist.search import _ctx


def test_profile_and_use_measured_times(zoo_graphs, tmp_path):
    graph = zoo_graphs["mlp"][0]
    db = profile_graph(graph, ways=(1, 2), repeats=1)
    linear = next(n for n in graph.nodes if n.op == "aten.linear.default")
    x, w = (graph.values[r].meta.shape for r in linear.input_names()[:2])
    key = op_key(
        linear.op,
        [x, w]
        + ([graph.values[linear.input_names()[2]].meta.shape] if len(linear.input_names()) > 2 else []),
        "float32",
    )
    assert key in db.entries and db.entries[key] > 0
    path = db.save(tmp_path / "ops.json")
    assert ProfileDB.load(path).entries == db.entries
    # a made-up measurement changes the cost the search sees
    fake = {k: 1.0 for k in db.entries}
    setup = planner_setup(graph, ComputeConfig(2, 2, pas_config={"cluster": "cpu_gloo"}))
    ctx = _ctx(setup, 1)
    measured = type(ctx)(**{**ctx.__dict__, "measured": fake})
    whole = node_choices(graph, linear, measured, MemoryModel(), set()).choices[0]
    assert whole.compute == 1.0
    assert node_choices(graph, linear, ctx, MemoryModel(), set()).choices[0].compute < 1.0
    assert solve_spmd(graph, measured, setup.memory).time > solve_spmd(graph, ctx, setup.memory).time
    plan = make_plan(
        graph,
        "autodist",
        ComputeConfig(2, 2, pas_config={"cluster": "cpu_gloo", "profile_db_path": str(path)}),
    )
    assert plan.policy == "autodist"
