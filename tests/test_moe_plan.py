"""Mixture of experts in the compiler: capture recognises the experts of each model as one op, the
`tp` / `hybrid` policies split them over `ep_size` devices (or refuse with a clear error), every rank's
generated code calls the all-to-alls in the same order, and a compiled model's router picks the same
experts as one device."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from nnscaler import ComputeConfig
from nnscaler.errors import PlanError
from nnscaler.graph.capture import capture
from nnscaler.graph.capture.moe import is_experts_module, use_moe_op
from nnscaler.policies.expert_parallel import experts_nodes
from nnscaler.policies.pipeline import pas_hybrid
from nnscaler.policies.tp import pas_tp
from tests import models_moe
from tests.dist_util import spawn

MODELS = ["build_mixtral", "build_qwen2_moe", "build_deepseek_v3", "build_hand"]


def _graph(name: str):
    model, make_batch = getattr(models_moe, name)(0)
    return model, capture(model, make_batch(0, 4), both_modes=False)


@pytest.mark.parametrize("name", MODELS)
def test_capture_makes_one_experts_op_per_layer(name):
    model, graph = _graph(name)
    paths = [p for p, m in model.named_modules() if is_experts_module(m)]
    nodes = experts_nodes(graph)
    assert [n.module_path for n in nodes] == paths and paths
    assert not any(n.op.startswith("transformers.grouped_mm") for n in graph.nodes)
    assert "forward" not in vars(dict(model.named_modules())[paths[0]])  # its own forward is back


def test_modules_off_contract_are_left_alone():
    experts = models_moe.DenseLoopExperts(4, 8, 6)
    assert is_experts_module(experts)
    experts.act_fn = torch.nn.Tanh()  # no known activation: its ops are captured one by one
    assert not is_experts_module(experts)
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        use_moe_op(models_moe.build_hand(0)[0], capacity_factor=0.0)


@pytest.mark.parametrize("ep,tp", [(2, 1), (4, 1), (2, 2)])
def test_tp_plan_splits_experts_on_the_ep_axis(ep, tp):
    _, graph = _graph("build_deepseek_v3")
    plan = pas_tp(graph, ComputeConfig(ep * tp, ep * tp, pas_config={"ep_size": ep}))
    for node in experts_nodes(graph):
        np = plan.node(node.name)
        if tp == 1:
            assert (np.split, np.ways) == ("e", ep)
        else:
            assert plan.mesh == (ep, tp) and np.mesh_splits == (("e", 1), ("i", 1))
    assert any("expert parallel" in n for n in plan.notes)


def test_hybrid_accepts_ep_size():
    _, graph = _graph("build_hand")
    pas = {"ep_size": 2, "pp_size": 2, "pipeline_nmicros": 2}
    cfg = ComputeConfig(4, 4, pas_config=pas, use_end2end=True)
    plan = pas_hybrid(graph, cfg)
    assert plan.pipeline.pp_size == 2
    assert all(plan.node(n.name).split == "e" for n in experts_nodes(graph))


def test_refusals_name_the_problem():
    _, graph = _graph("build_hand")  # 4 experts
    with pytest.raises(PlanError, match=r"ep_size'\]=8 does not divide the 4 experts of"):
        pas_tp(graph, ComputeConfig(8, 8, pas_config={"ep_size": 8}))
    with pytest.raises(PlanError, match="does not divide the 6 devices"):
        pas_tp(graph, ComputeConfig(6, 6, pas_config={"ep_size": 4}))
    with pytest.raises(PlanError, match="ep_size'\\] and pas_config\\['cp_size'\\] together"):
        pas_tp(graph, ComputeConfig(4, 4, pas_config={"ep_size": 2, "cp_size": 2}))
    from tests.zoo import build

    model, make_batch = build("mlp")
    plain = capture(model, make_batch(0, 4), both_modes=False)
    with pytest.raises(PlanError, match="no recognised mixture-of-experts layer"):
        pas_tp(plain, ComputeConfig(2, 2, pas_config={"ep_size": 2}))


def _routing_worker(rank: int, world: int, root: str) -> list:
    import nnscaler
    from nnscaler.runtime.moe import routing_log

    nnscaler.init()
    model, make_batch = models_moe.build_hand_aux(0)
    cfg = ComputeConfig(world, world, pas_config={"ep_size": world})
    pm = nnscaler.parallelize(model, make_batch(7, 4), "tp", cfg, gen_savedir=root)
    batch = make_batch(1, 4)
    rows = 4 // world
    routing_log.calls = []
    pm(**{k: v for k, v in batch.items()}).backward()
    calls, routing_log.calls = routing_log.calls, None
    assert rows == 1 and len(calls) == 2
    return calls


def test_router_choices_and_all_to_all_order_match(tmp_path):
    """ep 4 over 4 ranks: each rank's chosen experts (its batch rows) are one device's; and every
    rank's generated code calls the expert-parallel kernel in the same order over the same group."""
    from nnscaler.runtime.moe import routing_log

    per_rank = spawn(_routing_worker, 4, tmp_path, str(tmp_path / "gen"), timeout=300)
    model, make_batch = models_moe.build_hand_aux(0)
    use_moe_op(model)
    routing_log.calls = []
    model(**make_batch(1, 4))
    ref, routing_log.calls = routing_log.calls, None
    for layer, expected in enumerate(ref):
        got = torch.cat([calls[layer] for calls in per_rank])
        assert torch.equal(got, expected), f"layer {layer}: the ranks chose other experts than one device"
    order = set()  # every collective call of each rank's file, in program order
    codes = sorted(Path(tmp_path / "gen").rglob("gencode*.py"))
    for code in codes:
        order.add(tuple(re.findall(r"((?:comm|moe)\.\w+)\(", code.read_text())))
    assert len(codes) == 4 and len(order) == 1
    assert "moe.expert_parallel_experts" in next(iter(order))
