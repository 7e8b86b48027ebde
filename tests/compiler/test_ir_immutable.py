"""The IR is immutable after capture: planning and partitioning leave a captured graph as it was,
assigning to a Graph, Node or Value field raises, and facts cached for one graph are never served
for another (not even one with as many nodes)."""

from __future__ import annotations

import copy
import dataclasses
import gc
import weakref

import pytest
import torch

from nnscaler import ComputeConfig
from nnscaler.graph.ir import (
    Graph,
    GraphBuilder,
    Node,
    Ref,
    TensorMeta,
    Value,
    graph_fact,
    graph_facts,
    graph_from_json,
    graph_to_json,
)
from nnscaler.partition import apply_pipeline, apply_plan
from nnscaler.policies import make_plan
from nnscaler.policies.autodist.dataflow import crossing_values
from nnscaler.policies.autodist.memo import graph_memo
from nnscaler.policies.weighted import node_index

_PIPELINE = {"pipeline_nstages": 2, "pipeline_nmicros": 2}
_POLICIES = {
    "dp": ComputeConfig(1, 2),
    "data": ComputeConfig(2, 2),
    "tp": ComputeConfig(2, 2),
    "pp": ComputeConfig(2, 2, use_end2end=True, pas_config=_PIPELINE),
    "hybrid": ComputeConfig(4, 4, use_end2end=True, pas_config=_PIPELINE),
    "autodist": ComputeConfig(2, 2, pas_config={"cluster": "cpu_gloo"}),
}


def _assert_same_graph(graph: Graph, before: Graph) -> None:
    """Every field equal (constants: the same tensors), and no attribute beyond the fields."""
    for f in dataclasses.fields(Graph):
        now, was = getattr(graph, f.name), getattr(before, f.name)
        if f.name == "constants":
            assert now.keys() == was.keys()
            assert all(torch.equal(now[k], was[k]) for k in now if now[k] is not None)
        else:
            assert now == was, f"the graph's {f.name} changed"
    assert set(vars(graph)) == {f.name for f in dataclasses.fields(Graph)}, "something was set on the graph"


@pytest.mark.parametrize("policy", list(_POLICIES))
def test_planning_and_partitioning_leave_the_graph_as_captured(zoo_graphs, policy):
    graph = zoo_graphs["gpt"][0]
    before = copy.deepcopy(graph)
    plan = make_plan(graph, policy, _POLICIES[policy])
    if plan.pipeline is not None:
        apply_pipeline(graph, plan)
    else:
        apply_plan(graph, plan)
    _assert_same_graph(graph, before)


def test_a_captured_graph_holds_immutable_containers(zoo_graphs):
    graph = zoo_graphs["llama"][0]
    for f in dataclasses.fields(Graph):
        value = getattr(graph, f.name)
        assert not isinstance(value, (list, set)), f"Graph.{f.name} is a {type(value).__name__}"
    node = graph.nodes[0]
    assert isinstance(node.args, tuple) and isinstance(node.outputs, tuple)


def test_assigning_a_field_raises(zoo_graphs):
    graph = zoo_graphs["mlp"][0]
    node, value = graph.nodes[0], next(iter(graph.values.values()))
    with pytest.raises(dataclasses.FrozenInstanceError):
        graph.nodes = ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        graph.static_shapes = True
    with pytest.raises(dataclasses.FrozenInstanceError):
        node.args = ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        node.no_grad = True
    with pytest.raises(dataclasses.FrozenInstanceError):
        value.meta = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        graph._cache = {}  # no caches hung on the graph either
    with pytest.raises(TypeError, match="immutable"):
        graph.values["extra"] = value
    with pytest.raises(TypeError, match="immutable"):
        graph.module_classes.update({"x": "X"})
    with pytest.raises(TypeError, match="immutable"):
        node.kwargs["extra"] = 1
    with pytest.raises(AttributeError):
        graph.nodes.append(node)  # a tuple


def test_a_new_graph_is_made_with_replace_and_the_original_is_kept(zoo_graphs):
    graph = zoo_graphs["mlp"][0]
    first = graph.nodes[0]
    edited = dataclasses.replace(graph, nodes=[dataclasses.replace(first, no_grad=True), *graph.nodes[1:]])
    assert edited.nodes[0].no_grad and not graph.nodes[0].no_grad
    assert isinstance(edited.nodes, tuple)


def test_json_round_trip_gives_the_same_frozen_graph(zoo_graphs):
    graph = zoo_graphs["gpt"][0]
    text = graph_to_json(graph)
    again = graph_from_json(text)
    assert graph_to_json(again) == text
    assert isinstance(again.nodes, tuple) and isinstance(again.outputs, tuple)
    with pytest.raises(TypeError):
        again.values["x"] = again.values[again.inputs[0]]


def _two_node_graph(second_reads: str) -> Graph:
    """x -> a = relu(x); b = neg(<second_reads>); returns (a, b): two nodes whatever `second_reads` is."""
    meta = TensorMeta((4, 8), "float32", True)
    b = GraphBuilder(forward_args=["x"], inputs=["x"], input_leaves=["x"])
    b.values["x"] = Value("x", meta, "input", target="x")
    b.values["a"] = Value("a", meta, producer="relu")
    b.values["b"] = Value("b", meta, producer="neg")
    b.nodes.append(Node("relu", "aten.relu.default", (Ref("x"),), {}, ["a"]))
    b.nodes.append(Node("neg", "aten.neg.default", (Ref(second_reads),), {}, ["b"]))
    b.outputs = [Ref("a"), Ref("b")]
    return b.build()


def test_facts_are_per_graph_not_per_node_count():
    reads_input, reads_relu = _two_node_graph("x"), _two_node_graph("a")
    assert len(reads_input.nodes) == len(reads_relu.nodes)
    # the autodist memo (dataflow and its cuts): what crosses a cut before the second node
    assert crossing_values(reads_input, 1) == ("x",)
    assert crossing_values(reads_relu, 1) == ("a",)
    assert graph_memo(reads_input) is not graph_memo(reads_relu)
    # a graph derived from another with the same node count starts afresh too
    derived = dataclasses.replace(reads_input, nodes=reads_relu.nodes)
    assert crossing_values(derived, 1) == ("a",)
    consumers = lambda g: {k: [n.name for n in v] for k, v in g.consumers().items()}  # noqa: E731
    assert graph_fact(reads_input, "test_consumers", consumers)["x"] == ["relu", "neg"]
    assert graph_fact(derived, "test_consumers", consumers)["x"] == ["relu"]
    assert node_index(derived)["neg"] is reads_relu.nodes[1]
    # the facts live outside the graph
    assert "test_consumers" in graph_facts(reads_input)
    assert set(vars(reads_input)) == {f.name for f in dataclasses.fields(Graph)}


def test_facts_do_not_keep_their_graph_alive():
    graph = _two_node_graph("a")
    crossing_values(graph, 1)
    node_index(graph)
    ref = weakref.ref(graph)
    del graph
    gc.collect()
    assert ref() is None
