"""autodist's SPMD search: Megatron's layout where tensor parallelism is cheapest, data parallelism
where the batch is large, constraints and memory limits honoured, plans saved and loaded."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from nnscaler import ComputeConfig
from nnscaler.errors import PlanError
from nnscaler.graph.ir import Shard
from nnscaler.partition import apply_plan
from nnscaler.policies import make_plan
from nnscaler.policies.autodist import planner_setup, solve_spmd
from nnscaler.policies.autodist.context import stage_context

# Slow math, free memory traffic, fast links with real latency: splitting matmuls pays, and the
# layout with the fewest collectives wins (Megatron: one all-reduce after attention, one after the MLP).
TP_CLUSTER = {
    "device": {"name": "cpu", "fp32_tflops": 0.01, "mem_bw_gbs": 1e6, "kernel_overhead_us": 0},
    "devices_per_node": 8,
    "intra_node": {"bandwidth_gbs": 100, "latency_us": 10},
}
MATMULS = ("aten.linear.default", "aten.addmm.default")  # gpt2's Conv1D traces to addmm
BLOCKS = {"llama": "model.layers.1", "gpt": "transformer.h.1", "gpt2": "transformer.h.1"}


def _comms(program, block: str) -> Counter:
    return Counter(
        s.op
        for s in program.statements
        if s.kind == "comm" and (s.module_path == block or s.module_path.startswith(block + "."))
    )


def _cfg(cluster, **pas) -> ComputeConfig:
    return ComputeConfig(2, 2, pas_config={"cluster": cluster, **pas})


@pytest.mark.parametrize("model", ["llama", "gpt", "gpt2"])
def test_finds_megatron_layout_when_tp_is_cheapest(zoo_graphs, model):
    graph = zoo_graphs[model][0]
    plan = make_plan(graph, "autodist", _cfg(TP_CLUSTER))
    block = BLOCKS[model]
    program = apply_plan(graph, plan)
    comms = _comms(program, block)
    assert comms == Counter({"reduce_from_group": 2, "copy_to_group": 2}), comms
    linears = [n for n in graph.nodes if n.op in MATMULS and n.module_path.startswith(block + ".")]
    splits = [plan.node(n.name).split for n in linears]
    assert splits.count("k") == 2, splits  # row-parallel: attention output and MLP down projection
    assert all(s in ("n", "k") for s in splits), splits  # every other linear column-parallel
    weights = {t.original_name: t.layout for t in program.tensors if t.original_name.startswith(block + ".")}
    assert sum(isinstance(lay, Shard) for lay in weights.values()) >= 4, weights


def test_llama_attention_split_by_heads(zoo_graphs):
    graph = zoo_graphs["llama"][0]
    plan = make_plan(graph, "autodist", _cfg(TP_CLUSTER))
    sdpa = [n for n in graph.nodes if "scaled_dot_product_attention" in n.op]
    assert sdpa and all(plan.node(n.name).split == "g" for n in sdpa)  # kv-head groups


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_picks_data_parallel_for_a_large_batch(zoo_graphs, model):
    """Latency-free links and the batch scaled 64x: activations outweigh weights, so split the tokens."""
    graph = zoo_graphs[model][0]
    cluster = {**TP_CLUSTER, "intra_node": {"bandwidth_gbs": 100, "latency_us": 0}}
    setup = planner_setup(graph, _cfg(cluster))
    ctx = stage_context(setup, 2)
    big = type(ctx)(**{**ctx.__dict__, "batch_scale": 64.0})
    res = solve_spmd(graph, big, setup.memory)
    linears = [n for n in graph.nodes if n.op in MATMULS]
    tokens = {"_s0", "_s1", "m"}  # batch, sequence, or flattened tokens (addmm): weights whole
    assert len(linears) >= 8 and {res.plans[n.name].split for n in linears} <= tokens
    graph_tp = solve_spmd(graph, ctx, setup.memory)
    assert not {graph_tp.plans[n.name].split for n in linears} <= tokens


def test_small_model_on_slow_links_stays_replicated(zoo_graphs):
    """On gloo-like links a 64-wide model gains nothing from splitting: every op replicated."""
    graph = zoo_graphs["llama"][0]
    plan = make_plan(graph, "autodist", _cfg("cpu_gloo"))
    assert plan.split_summary()["split"] <= 2, plan.split_summary()


def test_repeated_layers_are_solved_once(zoo_graphs):
    graph = zoo_graphs["llama"][0]
    setup = planner_setup(graph, _cfg(TP_CLUSTER))
    res = solve_spmd(graph, stage_context(setup, 2), setup.memory)
    flat = solve_spmd(graph, stage_context(setup, 2), setup.memory, fold=False)
    assert res.stats["folded_nodes"] < flat.stats["folded_nodes"] == len(graph.nodes)
    assert res.stats["status"] == "Optimal"
    layer0 = [n.name for n in graph.nodes if n.module_path.startswith("model.layers.0.")]
    layer1 = [n.name for n in graph.nodes if n.module_path.startswith("model.layers.1.")]
    assert [res.plans[a] for a in layer0] == [res.plans[b] for b in layer1]
    assert res.time == pytest.approx(flat.time, rel=1e-6)  # folding loses nothing here


def test_partition_constraints_are_honoured(zoo_graphs):
    """Forbid splitting MLP linears on their output features: no such split may appear."""
    graph = zoo_graphs["llama"][0]
    rules = [{"name": "linear", "parent_module": "mlp", "allowed_splits": ["k"]}]
    plan = make_plan(graph, "autodist", _cfg(TP_CLUSTER, partition_constraints=rules))
    mlp = [n for n in graph.nodes if n.op == "aten.linear.default" and ".mlp." in n.module_path]
    assert mlp and all(plan.node(n.name).split in (None, "k") for n in mlp)
    never = [{"name": "aten.scaled_dot_product_attention.default", "allowed_partition_dims": []}]
    plan = make_plan(graph, "autodist", _cfg(TP_CLUSTER, partition_constraints=never))
    sdpa = [n for n in graph.nodes if "scaled_dot_product_attention" in n.op]
    assert all(plan.node(n.name).split is None for n in sdpa)


def test_partition_constraints_from_yaml(zoo_graphs, tmp_path):
    graph = zoo_graphs["llama"][0]
    path = tmp_path / "pc.yaml"
    path.write_text("- name: linear\n  parent_module: LlamaAttention\n  replica_allowed: false\n")
    plan = make_plan(graph, "autodist", _cfg(TP_CLUSTER, partition_constraints_path=str(path)))
    attn = [n for n in graph.nodes if n.op == "aten.linear.default" and ".self_attn." in n.module_path]
    assert attn and all(plan.node(n.name).split is not None for n in attn)


def test_memory_limit_forces_sharded_weights(zoo_graphs):
    """On gloo links everything stays whole, unless the memory limit leaves no room for whole weights."""
    graph = zoo_graphs["llama"][0]
    setup = planner_setup(graph, _cfg("cpu_gloo"))
    free = solve_spmd(graph, stage_context(setup, 2), setup.memory)
    tight = solve_spmd(graph, stage_context(setup, 2), setup.memory, mem_limit=free.memory * 0.7)
    assert tight.memory <= free.memory * 0.7 < free.memory
    assert sum(c.param_bytes for c in tight.choice.values()) < sum(
        c.param_bytes for c in free.choice.values()
    )
    with pytest.raises(PlanError, match="mem_constraint"):
        solve_spmd(graph, stage_context(setup, 2), setup.memory, mem_limit=1000.0)


def test_save_and_load_plan(zoo_graphs, tmp_path):
    graph = zoo_graphs["gpt2"][0]
    path = tmp_path / "plan.json"
    plan = make_plan(graph, "autodist", _cfg(TP_CLUSTER, save_plan_path=str(path)))
    saved = json.loads(path.read_text())
    assert saved["format"] == "nnscaler-autodist-plan/1" and saved["predicted"]["step_seconds"] > 0
    # loading ignores the cluster: the saved plan is used as it is, without searching
    again = make_plan(graph, "autodist", _cfg("cpu_gloo", load_plan_path=str(path)))
    assert again == plan
    with pytest.raises(PlanError, match="plan_ngpus=2"):
        make_plan(graph, "autodist", ComputeConfig(4, 4, pas_config={"load_plan_path": str(path)}))
    with pytest.raises(PlanError, match="another model"):
        make_plan(zoo_graphs["mlp"][0], "autodist", _cfg("cpu_gloo", load_plan_path=str(path)))


def test_unknown_key_and_bad_cluster_are_refused(zoo_graphs):
    from nnscaler.errors import ConfigError
    from nnscaler.policies.options import parse_pas_config

    with pytest.raises(ConfigError, match="did you mean 'mem_constraint'"):
        parse_pas_config("autodist", {"mem_constrain": 10})
    with pytest.raises(ConfigError, match="shipped"):
        make_plan(zoo_graphs["mlp"][0], "autodist", _cfg("no_such_cluster"))


def test_a_given_plan_is_costed_and_checked_without_a_solver(zoo_graphs):
    """Re-costing the search's own choice (one choice per node) reproduces its time and memory with no
    solver run, and a memory limit it exceeds is still an error."""
    graph = zoo_graphs["llama"][0]
    setup = planner_setup(graph, _cfg(TP_CLUSTER))
    ctx = stage_context(setup, 2)
    free = solve_spmd(graph, ctx, setup.memory)
    assert free.stats["solver"] in ("cbc", "highs") and any(p.is_split for p in free.plans.values())
    again = solve_spmd(graph, ctx, setup.memory, fixed=free.plans)
    assert again.stats["solver"].startswith("none")
    assert again.time == pytest.approx(free.time) and again.memory == pytest.approx(free.memory)
    assert again.plans == free.plans
    with pytest.raises(PlanError, match="mem_constraint"):
        solve_spmd(graph, ctx, setup.memory, fixed=free.plans, mem_limit=free.memory * 0.99)


def test_a_limit_below_every_nodes_leanest_choice_fails_before_solving(zoo_graphs, monkeypatch):
    """Where even the leanest choice of every node exceeds the limit, the answer is known without a
    program; just above that bound the solver still runs and decides."""
    import pulp

    graph = zoo_graphs["llama"][0]
    setup = planner_setup(graph, _cfg("cpu_gloo"))
    ctx = stage_context(setup, 2)
    lean = solve_spmd(graph, ctx, setup.memory, mem_limit=solve_spmd(graph, ctx, setup.memory).memory * 0.7)
    solves = []
    real_solve = pulp.LpProblem.solve
    monkeypatch.setattr(
        pulp.LpProblem, "solve", lambda self, *a, **k: solves.append(1) or real_solve(self, *a, **k)
    )
    with pytest.raises(PlanError, match="mem_constraint"):
        solve_spmd(graph, ctx, setup.memory, mem_limit=lean.memory * 0.5)
    assert solves == []
    assert solve_spmd(graph, ctx, setup.memory, mem_limit=lean.memory * 1.001).memory <= lean.memory * 1.001
    assert solves == [1]
