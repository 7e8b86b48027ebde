"""2-D plans as data: JSON round trip, validation errors that name the node and the fix, and the
partitioner's per-axis bookkeeping (local shapes, stored weight shards, f per axis)."""

from __future__ import annotations

import pytest

from nnscaler import ComputeConfig
from nnscaler.errors import PlanError
from nnscaler.graph.capture import capture
from nnscaler.graph.ir import MeshLayout, Replicate, Shard, storage_shard
from nnscaler.partition import AxisGroup, apply_plan
from nnscaler.policies import NodePlan, Plan, validate_plan
from tests import zoo


@pytest.fixture(scope="module")
def mlp_graph():
    model, make_batch = zoo.build("mlp")
    return capture(model, make_batch(0, 4), both_modes=False)


def _linear(graph, k: int = 0):
    return [n for n in graph.nodes if n.op == "aten.linear.default"][k]


def test_json_round_trip_keeps_mesh_and_mesh_splits(mlp_graph):
    fc1 = _linear(mlp_graph)
    plan = Plan("mine", 4, {fc1.name: NodePlan(mesh_splits=(("_s0", 1), ("n", 1)))}, mesh=(2, 2))
    back = Plan.from_json(plan.to_json())
    assert back == plan and back.node(fc1.name).mesh_splits == (("_s0", 1), ("n", 1))
    assert back.node(fc1.name).describe() == "(_s0, n)" and back.split_summary()["split"] == 1
    one_d = Plan("mine", 2, {fc1.name: NodePlan("n", 2)})
    assert "mesh" not in one_d.to_json() and Plan.from_json(one_d.to_json()) == one_d


def test_validation_names_node_and_fix(mlp_graph):
    fc1 = _linear(mlp_graph)
    cfg = ComputeConfig(4, 4)
    with pytest.raises(PlanError, match=r"has mesh_splits but the plan has no mesh: set Plan.mesh"):
        validate_plan(mlp_graph, Plan("p", 4, {fc1.name: NodePlan(mesh_splits=(("_s0", 1), ("n", 1)))}), cfg)
    with pytest.raises(PlanError, match=r"mesh \(2, 3\) must multiply to the 4 devices"):
        validate_plan(mlp_graph, Plan("p", 4, {}, mesh=(2, 3)), cfg)
    same = Plan("p", 4, {fc1.name: NodePlan(mesh_splits=(("n", 1), ("n", 1)))}, mesh=(2, 2))
    with pytest.raises(
        PlanError, match=rf"{fc1.name}.*one identifier split over two mesh axes is a 1-D split"
    ):
        validate_plan(mlp_graph, same, cfg)
    bad = Plan("p", 4, {fc1.name: NodePlan(mesh_splits=(("_s0", 1), ("zz", 1)))}, mesh=(2, 2))
    with pytest.raises(PlanError, match=r"mesh axis 1 \(2 devices\): 'zz' is not an identifier"):
        validate_plan(mlp_graph, bad, cfg)


def test_partition_bookkeeping(mlp_graph):
    fc1 = _linear(mlp_graph)
    # batch over axis 0, output features over axis 1: a quarter of the output on each device
    plan = Plan("p", 4, {fc1.name: NodePlan(mesh_splits=(("_s0", 1), ("n", 1)))}, mesh=(2, 2))
    program = apply_plan(mlp_graph, plan)
    out = program.local_meta[fc1.outputs[0]].shape
    assert tuple(out) == (2, 16)  # (4, 32) over (batch 2) x (features 2)
    assert program.layouts[fc1.outputs[0]] == MeshLayout((Shard(0), Shard(1)))
    weight = next(t for t in program.tensors if t.name == fc1.input_names()[1])
    assert weight.layout == MeshLayout((Replicate(), Shard(0)))
    # ranks (0, 1) and (1, 1) hold the same second half of the weight rows
    assert storage_shard(weight.layout, 1, (2, 2)) == storage_shard(weight.layout, 3, (2, 2)) == (0, 1, 2, 1)
    # its gradient is a partial sum over the batch axis: Megatron's f over axis 0 only
    f = [s for s in program.statements if s.op == "copy_to_group" and s.args[0].name.endswith(weight.name)]
    assert f and all(s.args[1] == AxisGroup(0) for s in f)
