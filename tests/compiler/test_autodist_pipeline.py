"""autodist's pipeline search: the stage DP (C++ and its Python twin give identical plans), and
pipelined plans from the policy."""

from __future__ import annotations

import math
import os
import random
import shutil
import subprocess
import sys

import pytest

from nnscaler import ComputeConfig
from nnscaler.errors import PlanError
from nnscaler.policies import make_plan
from nnscaler.policies.autodist import planner_setup, search
from nnscaler.policies.autodist.pipeline_dp import native_available, stage_dp, stage_dp_py


def test_stage_dp_by_hand():
    assert stage_dp_py([1, 1, 1, 1], [0] * 4, [0] * 4, 2, 1, math.inf) == (2.0, [0, 2])
    # the first segment's weights fill a stage on their own
    assert stage_dp_py([1, 1, 1, 1], [0] * 4, [3, 1, 1, 1], 2, 1, 3.0) == (3.0, [0, 1])
    # 1F1B: stage 0 keeps 2 micro-batches of activations, stage 1 one
    assert stage_dp_py([1, 1, 1, 1], [1, 1, 1, 1], [0] * 4, 2, 4, 3.0) == (3.0, [0, 1])
    assert stage_dp_py([1, 1], [0, 0], [5, 5], 2, 1, 4.0) == (math.inf, [])
    assert stage_dp_py([1], [0], [0], 2, 1, math.inf) == (math.inf, [])


def test_native_loop_is_built_where_a_compiler_exists():
    if shutil.which("g++") or shutil.which("c++"):
        assert native_available(), "a C++ compiler is present but the pybind11 module did not build"


def test_native_loop_is_found_from_outside_the_checkout(tmp_path):
    """cppimport must find the source by file, not by walking sys.path: an editable install (a path
    hook) puts no directory of the package there, and the planner silently fell back to Python."""
    if not (shutil.which("g++") or shutil.which("c++")):
        return  # no compiler: the fallback is what runs (test_python_fallback_plans_without_native)
    code = "from nnscaler.policies.autodist.pipeline_dp import native_available; print(native_available())"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True", out.stderr


def test_native_and_python_give_identical_plans():
    rng = random.Random(12)
    for _ in range(300):
        n = rng.randint(1, 24)
        stages = rng.randint(1, 8)
        times = [rng.choice([rng.random(), 0.5, 1.0]) for _ in range(n)]  # ties included
        acts = [rng.random() for _ in range(n)]
        params = [rng.random() for _ in range(n)]
        m, limit = rng.randint(1, 8), rng.choice([math.inf, rng.uniform(0.5, 8.0)])
        assert stage_dp(times, acts, params, stages, m, limit) == stage_dp_py(
            times, acts, params, stages, m, limit
        )


def test_python_fallback_plans_without_native(tmp_path):
    """NNSCALER_AUTODIST_NATIVE=0 stands for a machine without a compiler: the search still plans."""
    code = (
        "from nnscaler.policies.autodist.pipeline_dp import native_available, stage_dp\n"
        "assert not native_available()\n"
        "print(stage_dp([1.0, 2.0, 3.0, 1.0], [0.0] * 4, [0.0] * 4, 2, 1, float('inf')))\n"
    )
    env = {**os.environ, "NNSCALER_AUTODIST_NATIVE": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "(4.0, [0, 2])"


def _e2e(**pas) -> ComputeConfig:
    return ComputeConfig(2, 2, use_end2end=True, pas_config={"cluster": "cpu_gloo", **pas})


def test_fixed_stage_count_gives_a_pipeline(zoo_graphs):
    graph = zoo_graphs["llama"][0]
    plan = make_plan(graph, "autodist", _e2e(pipeline_nstages=2, pipeline_nmicros=4))
    p = plan.pipeline
    # one stage per device group: 1F1B or ZB-H1, whichever the search scores faster (here ZB-H1)
    assert p is not None and (p.nstages, p.pp_size, p.nmicros, p.scheduler) == (2, 2, 4, "zb_h1")
    start = next(n for n in graph.nodes if n.name == p.starts[1])
    assert start.module_path.startswith("model.layers.1")  # two equal layers: one per stage
    assert plan.tp_size == 1 and plan.split_summary()["split"] == 0


def test_search_scores_every_configuration(zoo_graphs):
    graph = zoo_graphs["llama"][0]
    setup = planner_setup(graph, _e2e(pipeline_nmicros=4, pipeline_scheduler="1f1b"))
    best, scored = search(graph, setup)
    labels = {c.label() for c in scored}
    assert {"pp=1 tp=2 nmicros=4", "pp=2 tp=1 nmicros=4", "pp=2 tp=1 nmicros=4, recompute"} <= labels
    assert best.time_per_micro == min(c.time_per_micro for c in scored)
    pipe = next(c for c in scored if c.label() == "pp=2 tp=1 nmicros=4")
    # the whole step: (nmicros + stages - 1) slowest stages, plus sends and the gradient sync
    assert pipe.step_time >= (4 + 1) * max(pipe.stage_times)


def test_memory_forces_recompute_or_pipeline(zoo_graphs):
    graph = zoo_graphs["llama"][0]
    setup = planner_setup(graph, _e2e(pipeline_nmicros=4))
    best, scored = search(graph, setup)
    from dataclasses import replace

    smallest = min(c.memory for c in scored)  # recompute or a pipeline keeps the least
    assert smallest < best.memory * 0.75
    limit = smallest * 1.2 + 0.1 * best.memory  # room for the transient buffers, under the best's memory
    assert limit < best.memory
    again, _ = search(graph, replace(setup, mem_limit=limit))
    assert again.memory <= limit
    assert again.label() != best.label()
    with pytest.raises(PlanError, match="autodist"):
        search(graph, replace(setup, mem_limit=1000.0))


def test_pipelines_need_end2end(zoo_graphs):
    graph = zoo_graphs["llama"][0]
    cfg = ComputeConfig(
        2, 2, pas_config={"cluster": "cpu_gloo", "pipeline_nstages": 2, "pipeline_nmicros": 2}
    )
    with pytest.raises(PlanError, match="autodist"):
        make_plan(graph, "autodist", cfg)


def test_stage_count_without_repeated_layers_names_the_fix(zoo_graphs):
    """An MLP of three differently shaped linears has no layer list: say so and name pipeline_pivots."""
    graph = zoo_graphs["mlp"][0]
    with pytest.raises(PlanError, match=r"pipeline_nstages=2 needs at least 2 layers.*pipeline_pivots"):
        make_plan(graph, "autodist", _e2e(pipeline_nstages=2, pipeline_nmicros=2))
    plan = make_plan(
        graph, "autodist", _e2e(pipeline_nstages=2, pipeline_nmicros=2, pipeline_pivots="Linear")
    )
    assert plan.pipeline is not None and plan.pipeline.nstages == 2


def test_pivots_that_match_nothing_are_an_error(zoo_graphs):
    graph = zoo_graphs["llama"][0]
    with pytest.raises(PlanError, match="LlamaDecoderLayr.*match no module"):
        make_plan(graph, "autodist", _e2e(pipeline_pivots="LlamaDecoderLayr"))


def test_stage_boundary_carries_every_crossing_tensor(zoo_graphs):
    """Between two decoder layers travel the hidden state, the rotary tables both layers read and the
    labels the loss reads at the end, not only the layer's first input."""
    from nnscaler.policies.autodist.dataflow import crossing_values
    from nnscaler.policies.autodist.layers import layer_instances

    graph = zoo_graphs["llama"][0]
    _, instances = layer_instances(graph)
    second = instances[1][1][0]
    crossing = crossing_values(graph, second)
    kinds = {graph.values[v].kind for v in crossing}
    assert kinds == {"activation", "input"}
    shapes = sorted(graph.values[v].meta.shape for v in crossing)
    assert (4, 16, 64) in shapes and shapes.count((1, 16, 16)) == 2  # hidden, cos and sin
    assert graph.nodes[second].input_names()[0] in crossing
    assert not any(graph.values[v].kind == "param" for v in crossing)
