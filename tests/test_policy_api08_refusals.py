"""What a Plan cannot express is refused naming the nnScaler 0.8 policy-API call, never approximated;
and the custom-policy path tells 0.8-style policies from ours (annotated, unannotated, dotted path)."""

from __future__ import annotations

import pytest

from nnscaler import ComputeConfig
from nnscaler.errors import PlanError
from nnscaler.graph import IRGraph
from nnscaler.graph.capture import capture
from nnscaler.graph.ir import Graph
from nnscaler.graph.schedule.predefined import PredefinedSched
from nnscaler.ir.operator import IRFwOperation
from nnscaler.policies import Plan, make_plan
from nnscaler.policies.policy_api08 import is_policy_api08
from tests import zoo
from tests.test_policy_api08 import p08_replicate

CFG = ComputeConfig(2, 2)
E2E = ComputeConfig(2, 2, use_end2end=True)


@pytest.fixture(scope="module")
def mlp() -> Graph:
    model, make_batch = zoo.build("mlp")
    return capture(model, make_batch(1, 4))


@pytest.fixture(scope="module")
def gpt() -> Graph:
    model, make_batch = zoo.build("gpt")
    return capture(model, make_batch(1, 4))


def _assign(graph: IRGraph, subs, devs) -> None:
    for dev, sub in zip(devs, subs):
        graph.assign(sub, dev)


def _rest(graph: IRGraph, skip: str = "") -> None:
    for node in graph.select(ntype=IRFwOperation):
        if not node.device and node.origin != skip:
            _assign(graph, graph.replicate(node, times=2), [0, 1])


def _first_linear(graph: IRGraph) -> IRFwOperation:
    return graph.select(name="linear")[0]


def _refused(graph: Graph, policy, match: str, cfg: ComputeConfig = CFG) -> None:
    with pytest.raises(PlanError, match=match):
        make_plan(graph, policy, cfg)


def test_several_pieces_per_device_is_refused(mlp):
    def coshard(graph: IRGraph, cfg) -> IRGraph:  # swin's pas_mesh_shard: 4 pieces on 2 devices
        node = _first_linear(graph)
        _assign(graph, graph.partition(node, node.algorithm("dim"), idx=1, dim=0, num=4), [0, 0, 1, 1])
        _rest(graph)
        return graph

    _refused(mlp, coshard, r"graph\.partition\(linear, idx=1, dim=0, num=4\): 4 pieces over the 2 devices")


def test_pieces_out_of_device_order_are_refused(mlp):
    def swapped(graph: IRGraph, cfg) -> IRGraph:
        node = _first_linear(graph)
        _assign(graph, graph.partition(node, node.algorithm("dim"), idx=1, dim=0, num=2), [1, 0])
        _rest(graph)
        return graph

    _refused(mlp, swapped, r"graph\.assign\(\.\.\.\): the pieces of .* go to devices \[1, 0\]")


def test_unassigned_piece_and_unassigned_op_are_refused(mlp):
    def half(graph: IRGraph, cfg) -> IRGraph:
        node = _first_linear(graph)
        graph.assign(graph.partition(node, node.algorithm("dim"), idx=1, dim=0, num=2)[0], 0)
        _rest(graph, skip="linear")
        return graph

    def forgot(graph: IRGraph, cfg) -> IRGraph:
        return graph

    _refused(mlp, half, r"pieces \[1\] of graph\.partition\(linear, .*\) .* were never assigned")
    _refused(mlp, forgot, r"graph\.assign\(\.\.\.\): op linear \(aten\.linear\.default.*was never assigned")


def test_op_on_some_devices_only_is_refused(mlp):
    def one_device(graph: IRGraph, cfg) -> IRGraph:  # nnScaler's _replica(graph, node, [0]) at plan_ngpus 2
        for node in graph.select(ntype=IRFwOperation):
            graph.assign(node, 0)
        return graph

    def mixed(graph: IRGraph, cfg) -> IRGraph:
        graph.assign(_first_linear(graph), 0)
        _rest(graph)
        return graph

    _refused(
        mlp, one_device, r"graph\.assign\(\.\.\.\): the graph \(no graph\.staging\) runs on devices \[0\]"
    )
    _refused(
        mlp,
        mixed,
        r"graph\.assign\(linear, 0\) runs linear on devices \[0\], but its stage runs on devices \[0, 1\]",
    )


def test_nested_transform_and_late_staging_are_refused_at_the_call(mlp):
    def nested(graph: IRGraph, cfg) -> IRGraph:
        node = _first_linear(graph)
        piece = graph.partition(node, node.algorithm("dim"), idx=1, dim=0, num=2)[0]
        graph.replicate(piece, times=2)
        return graph

    def late(graph: IRGraph, cfg) -> IRGraph:
        _rest(graph)
        graph.staging([graph.select(ntype=IRFwOperation)[0]])
        return graph

    _refused(
        mlp,
        nested,
        r"graph\.replicate\(linear, times=2\): linear was already transformed by graph\.partition",
    )
    _refused(mlp, late, r"graph\.staging\(\[linear\]\): call graph\.staging before any graph\.partition")


def test_bad_device_and_bad_split_fail_at_the_call(mlp):
    def far(graph: IRGraph, cfg) -> IRGraph:
        graph.assign(_first_linear(graph), 5)
        return graph

    _refused(mlp, far, r"graph\.assign\(linear, 5\): device must be one of the plan devices 0\.\.1")
    front = IRGraph(mlp, 2)
    node = _first_linear(front)
    with pytest.raises(ValueError, match=r"Fail to partition node linear_2 .* has size 8"):
        graph_node = front.select(name="linear")[2]  # fc3: 8 outputs, 3 ways
        front.partition(graph_node, graph_node.algorithm("dim"), idx=1, dim=0, num=3)
    with pytest.raises(ValueError, match=r"only algorithm\('dim'\)"):
        node.algorithm("tp")
    assert not node.algorithm("dim").satisfy(idx=5, dim=0, num=2)


def _two_stages(graph: IRGraph) -> None:
    ops = graph.select(ntype=IRFwOperation)
    graph.staging([ops[0], next(n for n in ops if "transformer.h.1" in n.module_stack)])


def test_primitives_without_a_plan_equivalent_are_refused(mlp):
    def fused(graph: IRGraph, cfg) -> IRGraph:
        graph.fuse(graph.select(name="linear"))
        return graph

    _refused(mlp, fused, r"graph\.fuse\(\.\.\.\): nnScaler 0\.8's fuse has no equivalent in a Plan")
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        IRGraph(mlp, 2).nonsense  # noqa: B018


def test_pipeline_refusals_name_the_call(gpt):
    def no_schedule(graph: IRGraph, cfg) -> IRGraph:
        _two_stages(graph)
        for k, stage in enumerate(graph.nodes()):
            graph.assign(stage, k)
        return graph

    def chimera(graph: IRGraph, cfg) -> IRGraph:
        no_schedule(graph, cfg)
        PredefinedSched.sched_chimera_direct(graph, 2, 2)
        return graph

    def crossed(graph: IRGraph, cfg) -> IRGraph:  # stage 0 on device 1: a Plan puts stage s on group s
        _two_stages(graph)
        for k, stage in enumerate(graph.nodes()):
            graph.assign(stage, 1 - k)
        cfg.apply_pipeline_scheduler(graph, 2, 2, "1f1b")
        return graph

    _refused(gpt, no_schedule, r"graph\.staging\(\[arange, .*\]\): a staged graph needs a schedule", E2E)
    _refused(
        gpt,
        chimera,
        r"PredefinedSched\.sched_chimera_direct\(graph, 2, 2\): schedule 'chimera_direct' is not one we run",
        E2E,
    )
    _refused(
        gpt, crossed, r"graph\.assign\(\.\.\.\): stage 0 of graph\.staging\(.*\) runs on devices \[1\]", E2E
    )


def test_recompute_of_part_of_a_module_is_refused(mlp):
    def partial(graph: IRGraph, cfg) -> IRGraph:
        graph.recompute(graph.select(name="gelu"))  # the root module's gelus, not its linears
        _rest(graph)
        return graph

    _refused(mlp, partial, r"graph\.recompute\(\[gelu, gelu_1\]\): op gelu is in module \(root\)")


def test_a_0_8_policy_returns_the_graph(mlp):
    def returns_none(graph: IRGraph, cfg) -> None:
        _rest(graph)

    _refused(
        mlp,
        returns_none,
        r"policy returns_none returned NoneType: an nnScaler 0\.8-style policy returns the IRGraph",
    )


def test_policy_styles_are_told_apart(mlp):
    def ours(graph: Graph, cfg) -> Plan:
        return Plan("ours", cfg.plan_ngpus)

    def unannotated(graph, cfg):
        _rest(graph)
        return graph

    assert is_policy_api08(p08_replicate) and not is_policy_api08(ours) and not is_policy_api08(unannotated)
    assert make_plan(mlp, ours, CFG).policy == "ours"
    assert make_plan(mlp, unannotated, CFG).policy == "unannotated"  # fails on Graph.select, run 0.8-style
    by_path = make_plan(mlp, "tests.test_policy_api08.p08_replicate", CFG)
    assert by_path == make_plan(mlp, p08_replicate, CFG) and not by_path.split_summary()["split"]
