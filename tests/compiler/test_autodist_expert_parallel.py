"""autodist searches the expert-parallel degree (issue 30): every ep dividing the plan devices and every
layer's experts, each degree's remaining devices planned as the per-rank problem plus the all-to-alls
on the ep ranks' link, the experts' memory and gradient sync divided by ep. Mixtral-8x7B's widths
(two layers, meta device) on 16 H100s over two nodes take ep > 1 (tp = 16 would cross nodes); a
tiny Mixtral on a slow link keeps ep = 1; pins are honoured and refused as policy tp refuses them;
the report names the degree; a pinned ep_size 2 trains like one device on 4 gloo ranks. The experts
op's compute is a roofline per grouped GEMM with a small-GEMM efficiency (autodist/expert_gemm.py):
its terms, and DeepSeek-V3's widths on 16 H100s over two nodes taking wide ep."""

from __future__ import annotations

import pytest
import torch

from nnscaler import ComputeConfig
from nnscaler.errors import PlanError
from nnscaler.graph.capture import capture
from nnscaler.policies.autodist import load_cluster, planner_setup, search
from nnscaler.policies.autodist.choices import node_choices, tensor_refs
from nnscaler.policies.autodist.context import stage_context
from nnscaler.policies.autodist.cp_search import evaluate_any_plan
from nnscaler.policies.autodist.devices import get_device
from nnscaler.policies.autodist.ep_search import ep_setup
from nnscaler.policies.autodist.expert_gemm import (
    K_FILL,
    TILE_M,
    TILE_N,
    ExpertShapes,
    experts_time,
    gemm_time,
    shape_efficiency,
)
from nnscaler.policies.autodist.expert_parallel import A2A_PER_MICRO, MoeLayer, ep_cost
from nnscaler.policies.autodist.policy import plan_from_candidate
from nnscaler.policies.autodist.recipes import standard_recipes
from nnscaler.policies.autodist.report import plan_report
from nnscaler.policies.expert_parallel import experts_nodes
from nnscaler.policies.plan import REPLICATE
from tests import models_moe, zoo
from tests.parity import ParityCase, run_parity_many

SLOW = {  # every device its own node, a slow high-latency link between them
    "name": "slow",
    "device": "h100",
    "nodes": 4,
    "devices_per_node": 1,
    "inter_node": {"bandwidth_gbs": 1.0, "latency_us": 200.0},
}


def _mixtral_8x7b_graph(layers: int = 2):
    """Mixtral-8x7B's widths (8 experts top-2, intermediate 14336) with `layers` layers, on meta,
    batch 8 x 1,024 tokens (expert parallelism splits the batch)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        use_cache=False,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        sliding_window=None,
        router_jitter_noise=0.0,
    )
    zoo._settle(config)
    with torch.device("meta"):
        model = zoo._settle_model(MixtralForCausalLM(config))
    ids = torch.zeros(8, 1024, dtype=torch.long, device="meta")
    return capture(model, {"input_ids": ids, "labels": ids}, both_modes=False)


@pytest.fixture(scope="module")
def big_graph():
    return _mixtral_8x7b_graph()


@pytest.fixture(scope="module")
def tiny_graph():
    model, make_batch = models_moe.build_mixtral(0)
    return capture(model, make_batch(0, 4), both_modes=False)


def _search(graph, ngpus: int, cluster="h100x8", runtime: int | None = None, **pas):
    cfg = ComputeConfig(ngpus, runtime or ngpus, pas_config={"cluster": cluster, "use_bf16": True, **pas})
    setup = planner_setup(graph, cfg)
    best, scored = search(graph, setup)
    return best, scored, setup


def test_ep_is_taken_where_tensor_parallelism_would_cross_nodes(big_graph):
    best, scored, setup = _search(big_graph, 16, "h100x64_ib")
    assert best.ep > 1 and best.pp * best.ep * best.tp == 16, best.label()
    assert best.tp <= 8  # tp stays in a node, ep takes the devices across nodes
    without = min((x for x in scored if x.ep == 1), key=lambda x: x.step_time)
    assert without.step_time > best.step_time
    assert best.ep_bytes > 0 and 0 < best.ep_comm < best.step_time
    rejected = dict(best.ep_rejected)
    assert "without expert parallelism the experts are split by tp=" in rejected["ep=1"]
    assert "does not divide the 8 experts" in rejected["ep=16"]

    plan = plan_from_candidate(big_graph, best, setup)
    assert plan.plan_ngpus == 16 and plan.mesh[0] == best.ep
    for node in experts_nodes(big_graph):
        assert plan.node(node.name).mesh_splits[0][0] == "e"
    again = evaluate_any_plan(big_graph, setup, plan)  # the plan re-costed: the same ep, its all-to-alls
    assert again.ep == best.ep and again.ep_bytes == pytest.approx(best.ep_bytes)
    report = plan_report(big_graph, plan, setup, recipes=False)
    assert "## Expert parallelism" in report
    assert f"Chosen: ep={best.ep} over mesh axis 0" in report and "inter-node" in report
    assert "| moe_experts | 8 (" in report  # the per-layer all-to-all bytes
    assert "- ep=1: predicted" in report  # why ep 1 was not taken


def test_all_to_all_bytes_follow_the_formula(big_graph):
    """One buffer = tokens per rank x hidden x top-k x 2 bytes (bf16); 4 per layer per micro-batch."""
    best, _, _ = _search(big_graph, 16, "h100x64_ib", ep_size=2)
    tokens_per_rank = 8 * 1024 // 2
    per_layer = tokens_per_rank * 4096 * 2 * 2
    assert best.ep_bytes == pytest.approx(2 * A2A_PER_MICRO * per_layer * best.nmicros)


def test_a_slow_link_and_tiny_experts_keep_ep_off(tiny_graph):
    best, scored, setup = _search(tiny_graph, 4, SLOW)
    assert best.ep == 1, best.label()
    assert {x.ep for x in scored} == {1, 2, 4}  # every degree dividing 4 experts and 4 devices scored
    rejected = dict(best.ep_rejected)
    assert "all-to-alls take" in rejected["ep=2"] and "all-to-alls take" in rejected["ep=4"]
    plan = plan_from_candidate(tiny_graph, best, setup)
    report = plan_report(tiny_graph, plan, setup, recipes=False)
    assert "Chosen: none (ep=1)" in report and "- ep=4: predicted" in report


def test_pinned_degree_is_honoured(tiny_graph):
    best, scored, setup = _search(tiny_graph, 4, SLOW, ep_size=2)
    assert best.ep == 2 and best.tp == 2 and all(x.ep == 2 for x in scored)
    assert not best.ep_rejected  # a pin is not weighed against the other degrees
    plan = plan_from_candidate(tiny_graph, best, setup)
    assert plan.mesh == (2, 2)
    best, scored, _ = _search(tiny_graph, 4, "h100x8", ep_size=1)
    assert best.ep == 1 and all(x.ep == 1 for x in scored) and not best.ep_rejected


def test_models_without_experts_plan_as_before():
    model, make_batch = zoo.build("mlp")
    graph = capture(model, make_batch(0, 4), both_modes=False)
    auto, scored, setup = _search(graph, 2)
    assert auto.ep == 1 and not auto.ep_rejected and all(x.ep == 1 for x in scored)
    off, _, _ = _search(graph, 2, ep_size=1)
    assert (auto.label(), auto.step_time) == (off.label(), off.step_time)
    plan = plan_from_candidate(graph, auto, setup)
    assert "## Expert parallelism" not in plan_report(graph, plan, setup, recipes=False)
    with pytest.raises(PlanError, match="no recognised mixture-of-experts layer"):
        _search(graph, 2, ep_size=2)


def test_refusals_name_the_fix(tiny_graph):
    with pytest.raises(PlanError, match="ep_size'\\]=3 does not divide the 4 devices"):
        _search(tiny_graph, 4, ep_size=3)
    with pytest.raises(PlanError, match="ep_size'\\]=8 does not divide the 4 experts"):
        _search(tiny_graph, 8, ep_size=8)
    with pytest.raises(PlanError, match="together are not supported"):
        _search(tiny_graph, 4, ep_size=2, cp_size=2)


def test_recipes_cost_ep_and_tp_split_experts(tiny_graph):
    _, _, setup = _search(tiny_graph, 4)
    recipes = standard_recipes(tiny_graph, setup, 4)
    names = [r.name for r in recipes]
    assert "Megatron TP2 x PP1 x DP2 (experts split by tp)" in names
    assert {"EP2 x TP1 x DP2", "EP2 x TP2 x DP1", "EP4 x TP1 x DP1"} <= set(names)
    ep4 = next(r for r in recipes if r.name == "EP4 x TP1 x DP1")
    assert ep4.candidate.ep == 4 and ep4.candidate.ep_comm > 0


# ---- the cost model ---------------------------------------------------------------------------------


def test_ep_cost_terms():
    ib = load_cluster("h100x64_ib")
    layer = MoeLayer("moe", 8, 2, 64e6)
    inside = ep_cost([layer], 2, 4, ib, (1, 1, False))  # ranks 0 and 4: one node
    across = ep_cost([layer], 2, 8, ib, (1, 1, False))  # ranks 0 and 8: two nodes
    assert across.comm > 5 * inside.comm
    assert inside.bytes == pytest.approx(A2A_PER_MICRO * layer.a2a_bytes)
    assert inside.comm == pytest.approx(A2A_PER_MICRO * (ib.intra_node.alpha + 32e6 / ib.intra_node.beta))
    rc = ep_cost([layer], 2, 4, ib, (1, 1, True))
    assert rc.comm == pytest.approx(inside.comm * 6 / 4)  # the forward's two again
    piped = ep_cost([layer] * 4, 2, 4, ib, (8, 2, False))  # 4 layers over 2 stages, 8 micro-batches
    assert piped.bytes == pytest.approx(4 * A2A_PER_MICRO * layer.a2a_bytes * 8 / 2)
    assert ep_cost([layer], 1, 4, ib, (1, 1, False)).comm == 0.0


def test_the_per_rank_problem_keeps_1_over_ep_of_the_experts(tiny_graph):
    """Weights + gradients + Adam state of the experts op: 1/ep per rank, synced over dp replicas only."""
    setup = planner_setup(tiny_graph, ComputeConfig(4, 8, pas_config={"cluster": "h100x8"}))
    node = experts_nodes(tiny_graph)[0]
    owned = set(node.input_names()[3:])
    plain = stage_context(ep_setup(setup, 1), 1)
    split = stage_context(ep_setup(setup, 4), 1)
    assert (split.ep_degree, split.dp_size, split.experts_context().dp_size) == (4, 8, 2)
    before = node_choices(tiny_graph, node, plain, setup.memory, owned, only=REPLICATE).choices[0]
    after = node_choices(tiny_graph, node, split, setup.memory, owned, only=REPLICATE).choices[0]
    assert after.param_bytes == pytest.approx(before.param_bytes / 4)
    state = lambda c: c.memory - c.activation_bytes  # noqa: E731
    assert state(after) == pytest.approx(state(before) / 4)  # ZeRO 0: no sharding either way
    assert 0 < after.sync < before.sync


# ---- the experts op's compute: a roofline per grouped GEMM, small-GEMM efficiency ---------------------


def test_shape_efficiency_tiles_waves_and_pipeline_fill():
    big = shape_efficiency(TILE_M * 4, TILE_N * 4, 8192, 33, 132)  # 528 tiles: exactly 4 waves
    assert big == pytest.approx(8192 / (8192 + K_FILL))
    assert shape_efficiency(64, TILE_N * 4, 8192, 33, 132) == pytest.approx(big / 2)  # half a row tile
    assert shape_efficiency(TILE_M, TILE_N, 8192, 133, 132) == pytest.approx(
        133 / 264 * 8192 / (8192 + K_FILL)
    )  # one tile into a second wave
    assert shape_efficiency(TILE_M * 4, TILE_N * 4, 256, 33, 132) == pytest.approx(256 / (256 + K_FILL))


def test_gemm_time_is_the_roofline_of_flops_and_bytes():
    dev = get_device("h100")
    launch = dev.kernel_overhead_us * 1e-6
    m, n, k, g = 4096, 4096, 4096, 33  # compute-bound
    eff = dev.matmul_efficiency * shape_efficiency(m, n, k, g, dev.compute_units)
    want = 2 * m * n * k * g / (dev.bf16_tflops * 1e12 * eff) + launch
    assert gemm_time(m, n, k, g, dev, "bfloat16", 2) == pytest.approx(want)
    m = 16  # 16 rows per expert: reading the weights dominates
    moved = (m * k + k * n + m * n) * g * 2
    want = moved / (dev.mem_bw_gbs * 1e9 * dev.mem_efficiency) + launch
    assert gemm_time(m, n, k, g, dev, "bfloat16", 2) == pytest.approx(want)


def test_fine_grained_experts_split_by_tp_cost_more_than_whole_experts():
    """DeepSeek-V3's experts (H 7168, I 2048, 256 experts, top-8) at 4,096 tokens per tp group: split by
    tp 8 on I (every token on every rank) vs 32 whole experts per rank under ep 8, the same FLOPs."""
    dev = get_device("h100")
    tp8 = ExpertShapes(rows=4096 * 8, experts=256, hidden=7168, inter=2048 // 8)
    ep8 = ExpertShapes(rows=4096 // 8 * 8, experts=256 // 8, hidden=7168, inter=2048)
    assert tp8.rows * tp8.inter == ep8.rows * ep8.inter and tp8.m == ep8.m == 128
    t_tp8, t_ep8 = (experts_time(s, dev, "bfloat16", 2, True) for s in (tp8, ep8))
    assert t_tp8 > 1.5 * t_ep8
    ideal = 18 * ep8.rows * 7168 * 2048 / (dev.bf16_tflops * 1e12 * dev.matmul_efficiency)
    assert t_ep8 > 2 * ideal  # 128 rows per expert: memory-bound on the expert weights
    fwd = experts_time(ep8, dev, "bfloat16", 2, False)
    assert fwd < t_ep8 / 2  # forward only
    assert experts_time(ep8, dev, "bfloat16", 2, True, refwd=True) == pytest.approx(t_ep8 + fwd)


def test_node_choices_cost_the_experts_op_with_the_gemm_model(tiny_graph):
    setup = planner_setup(tiny_graph, ComputeConfig(4, 4, pas_config={"cluster": "h100x8"}))
    node = experts_nodes(tiny_graph)[0]
    ctx = stage_context(ep_setup(setup, 1), 1)
    choice = node_choices(tiny_graph, node, ctx, setup.memory, set(), only=REPLICATE).choices[0]
    hidden, idx, _, _, down = (tiny_graph.values[r].meta for r in tensor_refs(tiny_graph, node))
    shapes = ExpertShapes(hidden.shape[0] * idx.shape[1], down.shape[0], down.shape[1], down.shape[2])
    dtype = ctx.compute_dtype or hidden.dtype
    dev, nbytes = ctx.cluster.device, ctx.elem_bytes(hidden.dtype)
    want = experts_time(shapes, dev, dtype, nbytes, True, refwd=True)  # ep 1: the op reruns its forward
    assert choice.compute == pytest.approx(want)
    split = stage_context(ep_setup(setup, 2), 1)  # ep 2: 1/2 of the experts, plain autograd
    choice = node_choices(tiny_graph, node, split, setup.memory, set(), only=REPLICATE).choices[0]
    rows = shapes.rows * split.value_scale(tiny_graph, tensor_refs(tiny_graph, node)[0])
    want = experts_time(
        ExpertShapes(rows, shapes.experts // 2, shapes.hidden, shapes.inter), dev, dtype, nbytes, True
    )
    assert choice.compute == pytest.approx(want)


def _deepseek_v3_graph(layers: int = 2, batch: int = 64):
    """DeepSeek-V3's widths (hidden 7168, MLA, 256 routed experts top-8 + 1 shared, moe_intermediate
    2048, group-limited routing), `layers` layers (the first dense), batch x 1,024 tokens, on meta."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=layers,
        first_k_dense_replace=1,
        num_attention_heads=128,
        num_key_value_heads=128,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        max_position_embeddings=1024,
        rope_scaling=None,
        use_cache=False,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    zoo._settle(config)
    with torch.device("meta"):
        model = zoo._settle_model(DeepseekV3ForCausalLM(config))
    ids = torch.zeros(batch, 1024, dtype=torch.long, device="meta")
    return capture(model, {"input_ids": ids, "labels": ids}, both_modes=False)


def test_deepseek_v3_widths_take_wide_ep_on_two_h100_nodes():
    graph = _deepseek_v3_graph()
    best, scored, setup = _search(graph, 16, "h100x64_ib")
    assert best.ep >= 4 and best.ep * best.tp * best.pp == 16, best.label()
    assert best.memory <= setup.mem_limit
    tp_only = min((x for x in scored if x.ep == 1), key=lambda x: x.step_time)
    assert tp_only.step_time > 1.3 * best.step_time
    assert "experts are split by tp=" in dict(best.ep_rejected)["ep=1"]


# ---- parity ------------------------------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_pinned_ep2_trains_like_one_device(tmp_path, tiny_graph):
    cfg = ComputeConfig(4, 4, pas_config={"ep_size": 2, "cluster": "cpu_gloo"})
    best, _, setup = _search(tiny_graph, 4, "cpu_gloo", ep_size=2)
    assert plan_from_candidate(tiny_graph, best, setup).mesh[0] == 2
    case = ParityCase(
        "tests.models_moe:build_mixtral", "autodist", 4, {"pas_config": cfg.pas_config}, optimizer="sgd"
    )
    run_parity_many([case], 4, tmp_path=tmp_path, timeout=550)
