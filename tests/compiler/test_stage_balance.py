"""Balanced pipeline stages (policies/stage_balance.py) on models whose layers cost very different
amounts (tests/zoo_unequal.py): every stage within 1.3x of the others' FLOPs and holding weights, the
graph network's first stage doing real work, the shared DP's rules, and the planners that use it."""

from __future__ import annotations

import logging
import math
import random

import pytest

from nnscaler import ComputeConfig
from nnscaler.graph.capture import capture
from nnscaler.graph.ir import cut_graph
from nnscaler.policies import make_plan
from nnscaler.policies.autodist.pipeline_dp import stage_dp
from nnscaler.policies.op_cost import graph_costs
from nnscaler.policies.stage_balance import balanced_stages, stage_report_lines, stage_shares
from nnscaler.policies.stage_dp import stage_dp_py
from nnscaler.policies.staging import candidate_levels
from tests import zoo

_CONTRACTING = ("aten.linear", "aten.mm", "aten.bmm", "aten.matmul", "aten.addmm", "aten.conv")


@pytest.fixture(scope="module")
def graphs():
    out = {}
    for name in ("unequal", "gnn"):
        model, make_batch = zoo.build(f"tests.zoo_unequal:build_{name}")
        out[name] = capture(model, make_batch(1, 2))
    return out


def _cfg(plan: int, **pas) -> ComputeConfig:
    return ComputeConfig(plan, plan, use_end2end=True, pas_config={"pipeline_nmicros": 4, **pas})


def _starts(graph, plan) -> list[int]:
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    return [index[s] for s in plan.pipeline.starts]


@pytest.mark.parametrize("pp", [2, 4])
def test_unequal_stack_stages_are_within_1_3x_and_hold_weights(graphs, pp):
    graph = graphs["unequal"]
    plan = make_plan(graph, "pp", _cfg(pp))
    shares = stage_shares(graph, _starts(graph, plan))
    flops = [s.flops for s in shares]
    assert max(flops) / min(flops) <= 1.3, [f"{s.flops_share:.0%}" for s in shares]
    assert all(s.params_share > 0.1 for s in shares), [f"{s.params_share:.0%}" for s in shares]
    assert plan.notes and plan.notes[0].startswith("pipeline stages: FLOPs"), plan.notes


def test_blocks_alone_cannot_balance_the_unequal_stack(graphs):
    """The reason for finer starts: at layer boundaries only, 4 stages are 1.5x apart or worse."""
    graph = graphs["unequal"]
    blocks = candidate_levels(graph)[0][1]
    choice = balanced_stages(graph, 4, ())
    assert choice.level != "blocks" and not set(choice.starts) <= set(blocks)
    layers = [i for i, n in enumerate(graph.nodes) if n.module_path.split(".")[:1] == ["layers"]]
    costs = graph_costs(graph)
    per_layer: dict[str, float] = {}
    for i in layers:
        key = ".".join(graph.nodes[i].module_path.split(".")[:2])
        per_layer[key] = per_layer.get(key, 0.0) + costs.flops[i]
    assert max(per_layer.values()) / min(per_layer.values()) > 2, per_layer  # the layers are unequal


@pytest.mark.parametrize("pp", [2, 4])
def test_graph_network_first_stage_does_real_work(graphs, pp):
    graph = graphs["gnn"]
    plan = make_plan(graph, "pp", _cfg(pp))
    pieces = cut_graph(graph, _starts(graph, plan))
    first = pieces[0].graph.nodes
    assert any(n.op.startswith(_CONTRACTING) for n in first), [n.op for n in first]
    for piece in pieces:
        assert piece.params, f"stage {piece.index} holds no weights"
    shares = stage_shares(graph, _starts(graph, plan))
    assert min(s.flops_share for s in shares) > 0.1, [f"{s.flops_share:.0%}" for s in shares]


def test_no_stage_starts_where_a_large_activation_crosses(graphs):
    """The graph network's per-edge messages (edges x hidden, larger than the node states) never cross
    a stage boundary, nor does the experts' inner activation in the unequal stack."""
    for name in ("gnn", "unequal"):
        graph = graphs[name]
        costs = graph_costs(graph)
        blocks = candidate_levels(graph)[0][1][1:]
        typical = sorted(costs.cross_largest[i] for i in blocks)[len(blocks) // 2]
        for _, cands in candidate_levels(graph)[1:]:
            assert all(costs.cross_largest[i] <= typical for i in cands if i not in blocks)


def test_recomputed_modules_are_not_cut(graphs):
    graph = graphs["unequal"]
    plan = make_plan(graph, "pp", _cfg(4, recompute_modules="MixtureOfExperts"))
    for i in _starts(graph, plan)[1:]:
        before, here = graph.nodes[i - 1].module_path, graph.nodes[i].module_path
        for layer in ("layers.2", "layers.5"):  # the experts layers
            inside = [p == layer or p.startswith(layer + ".") for p in (before, here)]
            assert not all(inside), f"stage starts inside recomputed {layer} at node {i}"


def test_user_pivots_are_kept(graphs):
    graph = graphs["unequal"]
    plan = make_plan(graph, "pp", _cfg(2, pipeline_pivots="Attention"))
    for i in _starts(graph, plan)[1:]:
        assert graph.nodes[i].module_path.startswith("layers."), graph.nodes[i].module_path
        assert graph.module_classes[".".join(graph.nodes[i].module_path.split(".")[:2])] == "Attention"


def test_the_stage_log_says_each_stages_share(graphs, caplog):
    with caplog.at_level(logging.INFO, logger="nnscaler.policies.pipeline"):
        make_plan(graphs["unequal"], "hybrid", _cfg(4, pp_size=2, pipeline_nstages=2))
    lines = [r.getMessage() for r in caplog.records if "pipeline stages:" in r.getMessage()]
    assert lines and "heaviest/lightest" in lines[0] and "weights" in lines[0], lines


def test_autodist_pipeline_uses_the_balancer(graphs):
    graph = graphs["unequal"]
    cfg = ComputeConfig(
        2,
        2,
        use_end2end=True,
        pas_config={"cluster": "cpu_gloo", "pipeline_nstages": 2, "pipeline_nmicros": 2},
    )
    plan = make_plan(graph, "autodist", cfg)
    assert plan.pipeline is not None and plan.pipeline.nstages == 2
    shares = stage_shares(graph, _starts(graph, plan))
    assert all(s.params_share > 0.2 for s in shares), [f"{s.params_share:.0%}" for s in shares]
    assert any(n.startswith("pipeline stages:") for n in plan.notes), plan.notes


# ---- the shared DP ------------------------------------------------------------------------------------
def test_every_stage_gets_weights_when_it_can():
    # segment 0 is index arithmetic (cheap, no weights): without the rule it would be a stage alone
    time, params = [3.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0]
    assert stage_dp_py(time, [0.0] * 4, params, 2, 1, math.inf)[1] == [0, 1]
    _, starts = stage_dp_py(time, [0.0] * 4, params, 2, 1, math.inf, None, [0, 1, 1, 1])
    assert starts == [0, 2]


def test_a_boundary_where_much_crosses_is_avoided():
    time = [1.0, 1.0, 1.0, 1.0]
    assert stage_dp_py(time, [0.0] * 4, [0.0] * 4, 2, 1, math.inf)[1] == [0, 2]
    _, starts = stage_dp_py(time, [0.0] * 4, [0.0] * 4, 2, 1, math.inf, [0.0, 0.1, 5.0, 0.1])
    assert starts == [0, 1]


def test_ties_on_the_slowest_stage_balance_the_others():
    # one heavy segment decides the maximum; the other stages still split the light ones evenly
    t, starts = stage_dp_py([1.0, 1.0, 1.0, 1.0, 6.0], [0.0] * 5, [0.0] * 5, 3, 1, math.inf)
    assert t == 6.0 and starts == [0, 2, 4]


def test_native_and_python_agree_with_boundaries_and_needs():
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 20)
        stages = rng.randint(1, 6)
        times = [rng.choice([rng.random(), 0.5, 1.0]) for _ in range(n)]
        acts = [rng.random() for _ in range(n)]
        params = [rng.random() for _ in range(n)]
        cross = [rng.random() * 0.3 for _ in range(n)]
        need = [rng.randint(0, 1) for _ in range(n)]
        m, limit = rng.randint(1, 8), rng.choice([math.inf, rng.uniform(0.5, 8.0)])
        args = (times, acts, params, stages, m, limit, cross, need)
        assert stage_dp(*args) == stage_dp_py(*args)


def test_report_lines_name_every_stage(graphs):
    graph = graphs["unequal"]
    plan = make_plan(graph, "pp", _cfg(4))
    lines = stage_report_lines(graph, plan)
    rows = [line for line in lines if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 4 and rows[0].startswith("| 0 | embed |"), lines
    assert stage_report_lines(graph, make_plan(graph, "dp", ComputeConfig(1, 1))) == []


def test_without_repeated_layers_no_stage_is_left_without_weights():
    """nnScaler 0.8 splits the operators of a model without a ModuleList evenly; where that leaves a
    stage only index arithmetic (the graph network's degree computation), the stages are balanced."""
    model, make_batch = zoo.build("tests.zoo_unequal:build_gnn_flat")
    graph = capture(model, make_batch(1, 2))
    with pytest.warns(UserWarning, match=r"would leave stage\(s\) \[0\] without weights"):
        plan = make_plan(graph, "pp", _cfg(3))
    for piece in cut_graph(graph, _starts(graph, plan)):
        assert piece.params, f"stage {piece.index} holds no weights"
        assert any(n.op.startswith(_CONTRACTING) for n in piece.graph.nodes), piece.index


def test_crossing_bytes_are_what_a_stage_receives(graphs):
    """op_cost's crossing bytes at a boundary equal the bytes of the activations cut_graph makes the
    stage starting there receive (the cost the balancer charges is what the pipeline sends)."""
    for graph in graphs.values():
        costs = graph_costs(graph)
        for i in candidate_levels(graph)[0][1][1:]:
            received = cut_graph(graph, [0, i])[1].received
            metas = [graph.values[r].meta for r in received]
            nbytes = sum(m.numel * {"float32": 4, "int64": 8}[m.dtype] for m in metas)
            assert costs.cross_bytes[i] == nbytes, (graph.nodes[i].module_path, received)
