"""autodist chooses the mesh of a stage's devices: every factorisation into two axes is solved and the
cheapest taken; on several nodes the chosen mesh keeps tensor-parallel traffic inside a node; the
planning command pins a mesh with --mesh."""

from __future__ import annotations

import pytest
import yaml

from nnscaler import ComputeConfig
from nnscaler.graph.capture import capture
from nnscaler.policies import make_plan
from nnscaler.policies.autodist import load_cluster
from nnscaler.policies.autodist.context import PlannerSetup, mesh_options
from tests.mesh2d_policy import SLOW_LINK_CLUSTER, build_token_ffn


@pytest.fixture(scope="module")
def ffn_graph():
    model, make_batch = build_token_ffn()
    return capture(model, make_batch(0, 8), both_modes=False)


def _setup(tp_mesh) -> PlannerSetup:
    return PlannerSetup(cluster=load_cluster("cpu_gloo"), plan_ngpus=8, tp_mesh=tp_mesh)


def test_mesh_options_are_every_two_axis_factorisation():
    auto = _setup("auto")
    assert mesh_options(auto, 8) == ((2, 4), (4, 2))
    assert mesh_options(auto, 16) == ((2, 8), (4, 4), (8, 2))
    assert mesh_options(auto, 4) == ((2, 2),)
    assert mesh_options(auto, 2) == () and mesh_options(auto, 7) == ()
    assert mesh_options(auto, 8, pipelined=True) == ()
    assert mesh_options(_setup("off"), 8) == ()
    assert mesh_options(_setup((4, 2)), 8) == ((4, 2),)
    assert mesh_options(_setup((4, 2)), 4) == ()


def _two_nodes(devices_per_node: int) -> dict:
    """8 devices over 8 / devices_per_node nodes; the link between nodes 20x slower."""
    return {
        "name": f"{8 // devices_per_node} nodes of {devices_per_node}",
        "device": "cpu",
        "nodes": 8 // devices_per_node,
        "devices_per_node": devices_per_node,
        "intra_node": {"bandwidth_gbs": 1.0, "latency_us": 1},
        "inter_node": {"bandwidth_gbs": 0.05, "latency_us": 20},
    }


def _predicted_ms(plan) -> float:
    return float(plan.notes[0].split("predicted ")[1].split(" ms")[0])


@pytest.mark.parametrize("devices_per_node, chosen", [(2, (4, 2)), (4, (2, 4))])
def test_chosen_mesh_keeps_tensor_parallel_splits_inside_a_node(ffn_graph, devices_per_node, chosen):
    cluster = _two_nodes(devices_per_node)
    plan = make_plan(ffn_graph, "autodist", ComputeConfig(8, 8, pas_config={"cluster": cluster}))
    assert plan.mesh == chosen
    # axis 1 (the weights' split, Megatron's all-reduces) is the one that fits inside a node
    assert plan.mesh[1] <= devices_per_node
    linears = [n for n in ffn_graph.nodes if n.op == "aten.linear.default"]
    for node in linears:
        splits = plan.node(node.name).mesh_splits
        assert splits and all(ident is not None for ident, _ in splits), (node.name, splits)
    # the other mesh, pinned, puts that split across nodes and is predicted slower
    other = tuple(reversed(chosen))
    pinned = make_plan(
        ffn_graph, "autodist", ComputeConfig(8, 8, pas_config={"cluster": cluster, "tp_mesh": list(other)})
    )
    assert pinned.mesh in (other, ()) and _predicted_ms(pinned) > _predicted_ms(plan)


def test_plan_command_pins_the_mesh(tmp_path, capsys):
    from nnscaler.cli.plan import main

    cluster = tmp_path / "slow.yaml"
    cluster.write_text(yaml.safe_dump({**SLOW_LINK_CLUSTER, "devices_per_node": 4}))
    saved = tmp_path / "plan.json"
    args = ["--model", "tests.mesh2d_policy.build_token_ffn", "--cluster", str(cluster), "--batch", "4"]
    assert main(args + ["--mesh", "2x2", "--no-pipeline", "--save-plan", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "Mesh of each stage's devices: 2x2" in out
    from nnscaler.policies.autodist.plan_files import load_plan

    plan = load_plan(saved)
    assert plan.mesh == (2, 2)
    both = [
        n for n, p in plan.nodes.items() if p.mesh_splits and all(i is not None for i, _ in p.mesh_splits)
    ]
    assert any(n.startswith("linear") for n in both), plan.nodes
    with pytest.raises(SystemExit):
        main(args + ["--mesh", "4"])
