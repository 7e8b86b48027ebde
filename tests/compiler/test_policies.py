"""Plans: JSON round trip, built-in policies, Megatron-style tensor parallelism on transformer blocks."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch

from nnscaler import ComputeConfig
from nnscaler.errors import PlanError
from nnscaler.graph.capture import capture
from nnscaler.graph.ir import Shard
from nnscaler.parallel import compile_module
from nnscaler.parallel.unsplit import unsplit_weights
from nnscaler.partition import apply_plan
from nnscaler.policies import NodePlan, Plan, make_plan
from tests import zoo


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


# ---- tp beyond the Llama block: Falcon's parallel blocks and fused q/k/v, nn.MultiheadAttention ----
TP_FAMILIES = {
    "falcon_mq": lambda: zoo.build("falcon_mq"),
    "falcon_gqa": lambda: zoo.build("falcon_gqa"),
    **{
        f"mha_bf{int(bf)}_bias{int(bias)}": (lambda bf=bf, bias=bias: zoo.build_mha(0, bf, bias))
        for bf in (True, False)
        for bias in (True, False)
    },
}


@pytest.fixture(scope="module")
def tp_programs():
    """name -> (graph, tp plan over 2 devices, its program), traced once for this module."""
    out = {}
    for name, build in TP_FAMILIES.items():
        model, make_batch = build()
        graph = capture(model, make_batch(12345, 4), both_modes=False)  # train mode only: faster
        plan = make_plan(graph, "tp", ComputeConfig(2, 2))
        out[name] = (graph, plan, apply_plan(graph, plan))
    return out


def _layouts(program, prefix: str) -> dict[str, object]:
    return {t.original_name: t.layout for t in program.tensors if t.original_name.startswith(prefix)}


def _falcon_block_weights(program, block: str) -> dict[str, object]:
    lay = _layouts(program, block + ".")
    return {
        k.removeprefix(block + "."): v
        for k, v in lay.items()
        if k.endswith(".weight") and "ln_" not in k and "norm" not in k
    }


def test_tp_falcon_grouped_kv_splits_by_group(tp_programs):
    """new_decoder_architecture, 2 KV heads over 2 devices: the fused q/k/v rows are grouped per KV head
    ("(kv_groups (q_per_kv + 2) head_dim)"), so a contiguous split gives each device one whole group;
    both parallel branches are column -> row, one all-reduce per branch and per norm (two norms)."""
    graph, plan, program = tp_programs["falcon_gqa"]
    block = "transformer.h.1"
    assert _falcon_block_weights(program, block) == {
        "self_attention.query_key_value.weight": Shard(0),
        "self_attention.dense.weight": Shard(1),
        "mlp.dense_h_to_4h.weight": Shard(0),
        "mlp.dense_4h_to_h.weight": Shard(1),
    }
    comms = _block_comms(program, block)
    assert comms == Counter({"reduce_from_group": 2, "copy_to_group": 2}), comms
    sdpa = [n for n in graph.nodes if n.module_path.startswith(block) and "attention" in n.op]
    assert [plan.node(n.name).describe() for n in sdpa] == ["h/2"]


def test_tp_falcon_multi_query_splits_query_heads(tp_programs):
    """multi_query (one K/V head): the fused weight is split and its output gathered once (a weight
    holding split query rows and replicated K/V rows has no layout); the attention runs on each
    device's query heads with K/V whole; dense and the MLP are row / column parallel."""
    graph, plan, program = tp_programs["falcon_mq"]
    block = "transformer.h.1"
    weights = _falcon_block_weights(program, block)
    assert all(isinstance(lay, Shard) for lay in weights.values()), weights
    notes = {plan.node(n.name).note for n in graph.nodes if n.module_path.startswith(block)}
    assert any(
        n.startswith("column-parallel, output gathered: aten.slice.Tensor at modeling_falcon.py")
        for n in notes
    )
    assert "attention by query heads; inputs sliced locally" in notes
    comms = _block_comms(program, block)
    # forward: the q/k/v gather, one all-reduce per branch; query heads sliced locally; the norm
    # output and K, V (read whole by split attention) all-reduce their gradients in backward
    assert comms == Counter(
        {"reduce_from_group": 2, "gather_from_group": 1, "split_to_group": 1, "copy_to_group": 3}
    ), comms


@pytest.mark.parametrize("name", [k for k in TP_FAMILIES if k.startswith("mha")])
def test_tp_multihead_attention_splits_by_heads(tp_programs, name):
    """Packed in_proj_weight "(3 (heads head_dim))": split by heads in 3 blocks; out_proj row-parallel;
    per layer the Megatron count (one all-reduce after attention, one after the MLP), nothing else."""
    graph, plan, program = tp_programs[name]
    bias = name.endswith("1")
    want = {"attn.1.in_proj_weight": Shard(0, blocks=3), "attn.1.out_proj.weight": Shard(1)}
    if bias:
        want["attn.1.in_proj_bias"] = Shard(0, blocks=3)
    lay = _layouts(program, "attn.1.")
    assert {k: lay[k] for k in want} == want, lay
    assert _block_comms(program, "attn.1") == Counter({"reduce_from_group": 1, "copy_to_group": 1})
    comms = Counter(s.op for s in program.statements if s.kind == "comm")
    assert comms["gather_from_group"] == comms["all_to_all_in_group"] == 0, comms


class _ProjNorm(torch.nn.Module):
    """A linear read by a layer norm: no tensor-parallel pattern, kept whole."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 32)
        self.norm = torch.nn.LayerNorm(32)

    def forward(self, x):
        return self.norm(self.proj(x)).sum()


def test_unsplit_weights_name_the_op_that_kept_them_whole():
    graph = capture(_ProjNorm(), {"x": torch.randn(4, 16)})
    plan = make_plan(graph, "tp", ComputeConfig(2, 2))
    top = unsplit_weights(graph, plan, apply_plan(graph, plan).tensors)
    assert top[0].name == "proj.weight"
    assert top[0].reason.startswith("kept whole: no tensor-parallel pattern matched"), top[0].reason
    assert "aten.layer_norm.default at test_policies.py:" in top[0].reason, top[0].reason
    assert top[0].share == pytest.approx(512 / (512 + 32 + 64))


def test_compile_summary_lists_largest_unsplit_weights(tmp_path, caplog):
    """The compile log names the largest weights kept whole, their share and why (here: 32 features
    over 3 devices)."""
    model, make_batch = zoo.build("mlp")
    with caplog.at_level(logging.INFO, logger="nnscaler.parallel.compile"):
        result = compile_module(model, make_batch(0, 4), "tp", ComputeConfig(3, 3), tmp_path, "test")
    assert [w.name for w in result.unsplit[:3]] == ["fc2.weight", "fc1.weight", "fc3.weight"]
    assert len(result.unsplit) == 5
    text = caplog.text
    assert "largest weights kept whole on every device" in text
    assert (
        "fc2.weight (4.0 KiB, 54.9% of the parameters): kept whole: output features (size 32) cannot be split 3 ways"
        in text
    )
