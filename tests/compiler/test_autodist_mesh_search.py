"""autodist chooses the mesh of a stage's devices: every factorisation into two axes is solved and the
cheapest taken; on several nodes the chosen mesh keeps tensor-parallel traffic inside a node; the
planning command pins a mesh with --mesh."""

from __future__ import annotations

import ast

import pytest
import yaml

from nnscaler import ComputeConfig
from nnscaler.codegen import generate_code
from nnscaler.graph.capture import capture
from nnscaler.partition import apply_plan
from nnscaler.policies import make_plan
from nnscaler.policies.autodist import load_cluster
from nnscaler.policies.autodist.context import MAX_MESHES, PlannerSetup, mesh_options
from tests.mesh2d_policy import SLOW_LINK_CLUSTER, build_token_ffn


@pytest.fixture(scope="module")
def ffn_graph():
    model, make_batch = build_token_ffn()
    return capture(model, make_batch(0, 8), both_modes=False)


def _setup(tp_mesh) -> PlannerSetup:
    return PlannerSetup(cluster=load_cluster("cpu_gloo"), plan_ngpus=8, tp_mesh=tp_mesh)


def test_mesh_options_are_two_axis_then_three_axis_factorisations():
    auto = _setup("auto")
    assert mesh_options(auto, 8) == ((2, 4), (4, 2), (2, 2, 2))
    assert mesh_options(auto, 16) == ((2, 8), (4, 4), (8, 2), (2, 2, 4), (2, 4, 2), (4, 2, 2))
    assert mesh_options(auto, 4) == ((2, 2),)
    assert mesh_options(auto, 2) == () and mesh_options(auto, 7) == ()
    assert mesh_options(auto, 8, pipelined=True) == ()
    assert mesh_options(_setup("off"), 8) == ()
    assert mesh_options(_setup((4, 2)), 8) == ((4, 2),)
    assert mesh_options(_setup((4, 2)), 4) == ()
    assert mesh_options(_setup((2, 2, 2)), 8) == ((2, 2, 2),)
    assert mesh_options(_setup((2, 2, 2)), 16) == ()


def test_mesh_options_are_capped_and_prefer_a_last_axis_inside_a_node():
    setup = PlannerSetup(cluster=load_cluster("cpu_gloo").with_devices(32), plan_ngpus=32)
    per_node = setup.cluster.devices_per_node
    options = mesh_options(setup, 32)
    assert len(options) == MAX_MESHES
    assert options[:4] == ((2, 16), (4, 8), (8, 4), (16, 2))
    three = [m for m in options if len(m) == 3]
    assert three and all(m[-1] <= per_node for m in three), (per_node, options)


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
    with pytest.raises(SystemExit):
        main(args + ["--mesh", "2x2x2x2"])


def test_pinned_three_axis_mesh_splits_linears_on_every_axis_and_compiles(ffn_graph):
    """On 2 nodes of 4, a pinned 2 x 2 x 2 mesh: each linear takes the batch-like dim over axis 0 and
    its n and k over axes 1 and 2 (a 2-D weight split); every rank's code parses."""
    cfg = ComputeConfig(8, 8, pas_config={"cluster": _two_nodes(4), "tp_mesh": [2, 2, 2]})
    plan = make_plan(ffn_graph, "autodist", cfg)
    assert plan.mesh == (2, 2, 2)
    linears = [n.name for n in ffn_graph.nodes if n.op == "aten.linear.default"]
    for name in linears:
        splits = plan.node(name).mesh_splits
        assert len(splits) == 3 and all(ident is not None for ident, _ in splits), (name, splits)
        assert {ident for ident, _ in splits[1:]} == {"n", "k"}, (name, splits)
    program = apply_plan(ffn_graph, plan)
    shapes = {k: v.meta.shape for k, v in ffn_graph.values.items() if v.meta is not None}
    for rank in range(8):
        code = generate_code(program, rank, cfg, ffn_graph.module_class, plan.policy, shapes, "test")
        ast.parse(code)
        assert "tp_axis2" in code, rank


def test_plan_command_pins_a_three_axis_mesh(tmp_path, capsys):
    from nnscaler.cli.plan import main

    cluster = tmp_path / "slow.yaml"
    cluster.write_text(yaml.safe_dump(SLOW_LINK_CLUSTER))
    args = ["--model", "tests.mesh2d_policy.build_token_ffn", "--cluster", str(cluster), "--batch", "4"]
    assert main(args + ["--mesh", "2x2x2", "--no-pipeline"]) == 0
    assert "Mesh of each stage's devices: 2x2x2" in capsys.readouterr().out
