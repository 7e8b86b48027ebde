"""Plans: JSON round trip, built-in policies, Megatron-style tensor parallelism on transformer blocks."""

from __future__ import annotations

from collections import Counter

import pytest

from nnscaler import ComputeConfig
from nnscaler.errors import PlanError
from nnscaler.graph.ir import Shard
from nnscaler.partition import apply_plan
from nnscaler.policies import NodePlan, Plan, make_plan


@pytest.mark.parametrize("policy,cfg", [("dp", (1, 2)), ("data", (2, 2)), ("tp", (2, 4))])
def test_plan_json_round_trip(zoo_graphs, policy, cfg):
    graph = zoo_graphs["gpt"][0]
    plan = make_plan(graph, policy, ComputeConfig(*cfg))
    again = Plan.from_json(plan.to_json())
    assert again == plan


def _block_comms(program, block: str) -> Counter:
    return Counter(
        s.op
        for s in program.statements
        if s.kind == "comm" and (s.module_path == block or s.module_path.startswith(block + "."))
    )


@pytest.mark.parametrize(
    "model,block", [("gpt", "transformer.h.1"), ("gpt2", "transformer.h.1"), ("llama", "model.layers.1")]
)
def test_tp_is_megatron_style(zoo_graphs, model, block):
    """Per block: column then row linears, one all-reduce after attention and one after the MLP."""
    graph = zoo_graphs[model][0]
    plan = make_plan(graph, "tp", ComputeConfig(2, 2))
    notes = Counter(plan.node(n.name).note for n in graph.nodes if n.module_path.startswith(block + "."))
    assert notes["row-parallel"] == 2
    assert notes["column-parallel"] >= 2
    program = apply_plan(graph, plan)
    comms = _block_comms(program, block)
    assert comms["reduce_from_group"] == 2, comms  # forward: one after attention, one after the MLP
    assert comms["copy_to_group"] == 2, comms  # backward: one before attention, one before the MLP
    assert comms["gather_from_group"] == 0 and comms["all_to_all_in_group"] == 0, comms
    # every weight of a linear in the block is sharded
    linears = {t.original_name: t.layout for t in program.tensors if t.original_name.startswith(block + ".")}
    sharded = [n for n, lay in linears.items() if isinstance(lay, Shard)]
    assert len(sharded) >= 4, linears


def test_tp_fused_qkv_is_split_by_heads(zoo_graphs):
    graph = zoo_graphs["gpt"][0]
    program = apply_plan(graph, make_plan(graph, "tp", ComputeConfig(2, 2)))
    layout = {t.original_name: t.layout for t in program.tensors}["transformer.h.0.attn.c_attn.weight"]
    assert layout == Shard(0, blocks=3)


def test_tp_vocab_parallel_embedding_and_loss(zoo_graphs):
    graph = zoo_graphs["gpt"][0]
    program = apply_plan(graph, make_plan(graph, "tp", ComputeConfig(2, 2)))
    specials = {s.op for s in program.statements if s.kind == "special"}
    assert specials == {"vocab_parallel_embedding", "vocab_parallel_cross_entropy"}


def test_dp_needs_one_plan_device(zoo_graphs):
    with pytest.raises(PlanError, match="plan_ngpus == 1"):
        make_plan(zoo_graphs["mlp"][0], "dp", ComputeConfig(2, 2))


def test_custom_policy_with_indivisible_split_is_rejected(zoo_graphs):
    """A user policy splitting a dim the device count does not divide: PlanError naming node and size."""
    graph = zoo_graphs["mlp"][0]
    linear = next(n for n in graph.nodes if n.op == "aten.linear.default")

    def bad_policy(g, cfg):
        return Plan("bad", cfg.plan_ngpus, {linear.name: NodePlan("n", cfg.plan_ngpus)})

    with pytest.raises(PlanError, match=rf"{linear.name}.*'n'.*size 32.*3 devices"):
        make_plan(graph, bad_policy, ComputeConfig(3, 3))


def test_builtin_policy_falls_back_and_says_so(zoo_graphs):
    """tp over 3 devices cannot split 32 features: linears stay whole and the plan records why."""
    graph = zoo_graphs["mlp"][0]
    plan = make_plan(graph, "tp", ComputeConfig(3, 3))
    assert any("cannot be split 3 ways" in note for note in plan.notes), plan.notes
