"""autodist's 2-D splits: offered only over a mesh, costed one mesh axis at a time on that axis's link,
honouring constraints, and chosen where they beat every 1-D plan."""

from __future__ import annotations

import pytest

from nnscaler import ComputeConfig
from nnscaler.errors import PlanError
from nnscaler.graph.capture import capture
from nnscaler.graph.ir import MeshLayout, Partial, Replicate, Shard
from nnscaler.policies import make_plan
from nnscaler.policies.autodist.choices import node_choices
from nnscaler.policies.autodist.cluster import ClusterSpec, LinkSpec
from nnscaler.policies.autodist.comm import all_gather, all_reduce
from nnscaler.policies.autodist.cost import CostContext, reshard_time
from nnscaler.policies.autodist.devices import get_device
from nnscaler.policies.autodist.memory import MemoryModel
from tests.mesh2d_policy import SLOW_LINK_CLUSTER, build_token_ffn

FAST, SLOW = LinkSpec(100.0, 1.0), LinkSpec(1.0, 10.0)
# two devices per node: axis 1 of a 2 x 2 mesh (neighbours) stays inside a node, axis 0 crosses nodes
CLUSTER = ClusterSpec(get_device("h100"), nodes=2, devices_per_node=2, intra_node=FAST, inter_node=SLOW)


@pytest.fixture(scope="module")
def ffn_graph():
    model, make_batch = build_token_ffn()
    return capture(model, make_batch(0, 4), both_modes=False)


def _ctx(mesh=(2, 2)) -> CostContext:
    return CostContext(CLUSTER, ways=4, mesh=mesh)


def test_each_axis_uses_its_own_link():
    ctx = _ctx()
    assert ctx.axis_link(1) == FAST and ctx.axis_link(0) == SLOW
    nbytes = 8e6
    # (S0, R) -> (S0, S1): a local split on axis 1; backward all-gathers over axis 1 half the tensor
    cost = reshard_time(
        MeshLayout((Shard(0), Replicate())), MeshLayout((Shard(0), Shard(1))), nbytes, ctx, False, True
    )
    assert cost == pytest.approx(all_gather(nbytes / 2, 2, FAST))
    # the same move on axis 0 crosses the slow link
    cost0 = reshard_time(
        MeshLayout((Replicate(), Shard(1))), MeshLayout((Shard(0), Shard(1))), nbytes, ctx, False, True
    )
    assert cost0 == pytest.approx(all_gather(nbytes / 2, 2, SLOW)) and cost0 > 10 * cost
    # a split consumer holding its input whole along axis 0: Megatron's f over axis 0 only
    f = reshard_time(
        MeshLayout((Replicate(), Shard(1))), MeshLayout((Replicate(), Shard(1))), nbytes, ctx, True, True
    )
    assert f == pytest.approx(all_reduce(nbytes / 2, 2, SLOW))
    # 1-D layouts keep the 1-D model (one collective over all four devices)
    assert reshard_time(Partial(), Replicate(), nbytes, ctx, False, True) == pytest.approx(
        all_reduce(nbytes, 4, ctx.tp_link)
    )
    # nothing makes a partial sum
    assert reshard_time(Replicate(), MeshLayout((Partial(), Shard(0))), nbytes, ctx, False, True) == float(
        "inf"
    )


def test_2d_choices_only_over_a_mesh(ffn_graph):
    linear = next(n for n in ffn_graph.nodes if n.op == "aten.linear.default")
    with_mesh = node_choices(ffn_graph, linear, _ctx(), MemoryModel(), set())
    plans = [c.plan for c in with_mesh.choices]
    two_d = [p for p in plans if p.mesh_splits]
    assert two_d and all(p.mesh_splits[0][0] != p.mesh_splits[1][0] for p in two_d)
    # axis 0 takes a batch-like dim of the input, never the contracted one
    assert all(linear_input_dim(ffn_graph, linear, p.mesh_splits[0][0]) in (0, 1) for p in two_d)
    one_d = node_choices(ffn_graph, linear, _ctx(mesh=()), MemoryModel(), set())
    assert not any(c.plan.mesh_splits for c in one_d.choices)
    # a 2-D choice computes a quarter of the op and keeps a quarter of its output
    rep = next(c for c in with_mesh.choices if not c.plan.is_split)
    both = next(c for c in with_mesh.choices if c.plan.mesh_splits)
    assert both.activation_bytes == pytest.approx(rep.activation_bytes / 4)


def linear_input_dim(graph, node, ident: str) -> int:
    from nnscaler.graph.ops import annotate_node

    dims = annotate_node(node, graph).anno.inputs[0].dims
    return next(i for i, d in enumerate(dims) if ident in d.ids)


def _plan(graph, **pas):
    return make_plan(graph, "autodist", ComputeConfig(4, 4, pas_config={"cluster": SLOW_LINK_CLUSTER, **pas}))


def test_autodist_picks_a_2d_plan_where_it_is_faster(ffn_graph):
    two_d = _plan(ffn_graph)
    one_d = _plan(ffn_graph, tp_mesh="off")
    assert two_d.mesh == (2, 2) and sum(1 for p in two_d.nodes.values() if p.mesh_splits) >= 4
    assert one_d.mesh == () and not any(p.mesh_splits for p in one_d.nodes.values())

    def predicted(plan) -> float:
        return float(plan.notes[0].split("predicted ")[1].split(" ms")[0])

    assert predicted(two_d) < predicted(one_d)
    # the same search over an explicit mesh
    assert _plan(ffn_graph, tp_mesh=[2, 2]).nodes == two_d.nodes


def test_constraints_bind_both_axes(ffn_graph):
    # never split the output features of the up projections: no 2-D choice may put them on any axis
    rule = {"name": "linear", "parent_module": "ups", "allowed_partition_dims": ["0,0", "0,1"]}
    plan = _plan(ffn_graph, partition_constraints=[rule])
    ups = [n for n in ffn_graph.nodes if n.op == "aten.linear.default" and ".ups." in f".{n.module_path}."]
    assert ups
    for node in ups:
        p = plan.node(node.name)
        idents = [i for i, _ in p.mesh_splits if i] if p.mesh_splits else ([p.split] if p.is_split else [])
        assert all(linear_input_dim(ffn_graph, node, i) in (0, 1) for i in idents), p


def test_tp_mesh_errors_name_the_option(ffn_graph):
    with pytest.raises(PlanError, match=r"pas_config\['tp_mesh'\]"):
        _plan(ffn_graph, tp_mesh=[4])


def test_profiler_measures_2d_local_shapes(ffn_graph):
    from nnscaler.policies.autodist.profiler import profile_graph

    db = profile_graph(ffn_graph, ways=(4,), repeats=1)
    ctx = CostContext(CLUSTER, ways=4, mesh=(2, 2), measured={k: 7.0 for k in db.entries})
    linear = next(n for n in ffn_graph.nodes if n.op == "aten.linear.default")
    choices = node_choices(ffn_graph, linear, ctx, MemoryModel(), set()).choices
    two_d = [c for c in choices if c.plan.mesh_splits]
    assert two_d and all(c.compute == 7.0 for c in two_d)  # measured, not analytic
    # (batch x output features): the input keeps half its rows, the weight half its rows
    x, w = (ffn_graph.values[r].meta.shape for r in linear.input_names()[:2])
    assert any(f"{x[0] // 2}x{x[1]}x{x[2]};{w[0] // 2}x{w[1]}" in k for k in db.entries)
