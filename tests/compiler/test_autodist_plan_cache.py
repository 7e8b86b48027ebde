"""Planning speed (issue 42): what the search caches gives the plan it gives without the caches, and
what it prunes could not have won.

- an SPMD program met again (offline planning solves the same one under ZeRO 2 and 3 when a plan
  size has one replica; a pipeline stage's with and without recompute's weights) is not solved again,
  and the cached search chooses the same plan with the same predicted step;
- a mesh's program is stopped at the best objective of the meshes solved before it: the mesh cut off
  is no cheaper when solved to its own optimum;
- a node's bound annotation is computed once per graph.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from nnscaler.graph.capture import capture
from nnscaler.graph.ops import annotate_node
from nnscaler.policies.autodist import load_cluster
from nnscaler.policies.autodist import spmd as spmd_module
from nnscaler.policies.autodist.context import PlannerSetup, stage_context
from nnscaler.policies.autodist.memo import solution_caches_off
from nnscaler.policies.autodist.offline import plan_offline
from nnscaler.policies.autodist.spmd import NOT_CHEAPER, solve_spmd
from tests import zoo
from tests.mesh2d_policy import build_token_ffn


def _llama_graph():
    model, make_batch = zoo.build_llama()
    return capture(model, make_batch(0, 8), static_shapes=True, both_modes=False)


def _counted(monkeypatch) -> list[str]:
    """Every program handed to a solver (spmd._run), by its solver's name, appended to the list."""
    calls: list[str] = []
    run = spmd_module._run

    def counting(problem, program, solver, cutoff=None):
        status, name = run(problem, program, solver, cutoff)
        calls.append(name)
        return status, name

    monkeypatch.setattr(spmd_module, "_run", counting)
    return calls


def _summary(result) -> tuple:
    scored = sorted((c.label(), c.step_time, c.memory) for c in result.scored)
    return result.best.label(), result.best.step_time, result.setup.plan_ngpus, result.plan.nodes, scored


def test_cached_search_plans_as_the_uncached_one_and_solves_fewer_programs(monkeypatch):
    cluster = load_cluster("h100x8")
    calls = _counted(monkeypatch)
    with solution_caches_off():
        fresh = plan_offline(_llama_graph(), cluster, 8, pas_config={"use_bf16": True})
    uncached = len(calls)
    calls.clear()
    cached = plan_offline(_llama_graph(), cluster, 8, pas_config={"use_bf16": True})
    assert _summary(cached) == _summary(fresh)
    assert len(calls) < uncached, (len(calls), uncached)


def test_a_plan_size_of_one_replica_solves_zero_2_and_zero_3_once(monkeypatch):
    """plan_ngpus=8 of 8 devices: no data-parallel replica, so ZeRO 2 and ZeRO 3 (both searched, since cp
    could shard) cost every choice alike: the ZeRO-3 search hands no program to the solver."""
    cluster, pas = load_cluster("h100x8"), {"use_bf16": True, "pipeline_nstages": 1}
    calls = _counted(monkeypatch)
    result = plan_offline(_llama_graph(), cluster, 8, plan_ngpus=8, pas_config=pas)
    zeros = [label.split()[1] for label, _ in result.phases]
    assert "zero=2" in zeros and "zero=3" in zeros, result.phases
    solved = [name for name in calls if name in ("cbc", "highs")]
    calls.clear()
    with solution_caches_off():
        again = plan_offline(_llama_graph(), cluster, 8, plan_ngpus=8, pas_config=pas)
    assert len([name for name in calls if name in ("cbc", "highs")]) == 2 * len(solved) > 0
    assert [c.step_time for c in again.scored] == [c.step_time for c in result.scored]


@pytest.fixture(scope="module")
def ffn_graph():
    model, make_batch = build_token_ffn()
    return capture(model, make_batch(0, 8), both_modes=False)


def _two_nodes_of_4() -> dict:
    """8 devices on 2 nodes of 4, the link between them 20x slower: mesh 2 x 4 keeps the weights' split
    (axis 1) inside a node and is the cheapest (test_autodist_mesh_search.py)."""
    return {
        "name": "2 nodes of 4",
        "device": "cpu",
        "nodes": 2,
        "devices_per_node": 4,
        "intra_node": {"bandwidth_gbs": 1.0, "latency_us": 1},
        "inter_node": {"bandwidth_gbs": 0.05, "latency_us": 20},
    }


def test_a_mesh_cut_off_at_the_best_objective_could_not_have_won(ffn_graph):
    ctx = stage_context(PlannerSetup(cluster=load_cluster(_two_nodes_of_4()), plan_ngpus=8), 8)
    assert ctx.mesh_options == ((2, 4), (4, 2), (2, 2, 2))
    res = solve_spmd(ffn_graph, ctx)
    tried = res.stats["meshes"]
    assert res.mesh == (2, 4) and tried["2x4"] == res.stats["objective"]
    cut = [name for name, t in tried.items() if t == NOT_CHEAPER]
    assert cut == ["4x2", "2x2x2"], tried
    with solution_caches_off():  # each mesh's program solved alone, to its optimum
        for name in cut:
            mesh = tuple(int(a) for a in name.split("x"))
            alone = solve_spmd(ffn_graph, replace(ctx, mesh=mesh, mesh_options=()))
            assert alone.stats["objective"] >= res.stats["objective"], (name, alone.stats["objective"])
        chosen = solve_spmd(ffn_graph, replace(ctx, mesh=(2, 4), mesh_options=()))
    assert chosen.plans == res.plans and chosen.stats["objective"] == res.stats["objective"]


def test_a_bound_annotation_is_computed_once_per_graph(ffn_graph):
    node = next(n for n in ffn_graph.nodes if n.op == "aten.linear.default")
    first = annotate_node(node, ffn_graph)
    assert annotate_node(node, ffn_graph) is first
    other = replace(ffn_graph)  # an equal graph is another graph: its own annotations
    again = annotate_node(node, other)
    assert again is not first and again == first
