"""The annotation language: parsing, binding to shapes, splits; every zoo op annotated and shape-checked."""

from __future__ import annotations

import pytest

from nnscaler.errors import TraceError
from nnscaler.graph.ir import Partial, Replicate, Shard
from nnscaler.graph.ops import (
    AnnotationError,
    annotate_node,
    bind_annotation,
    parse_annotation,
    split_candidates,
    split_layouts,
)


def test_parse_round_trip():
    for text in ["* k+, n k+ -> * n", "a b (h d^) -> a b h d^", "?, n^ -> n^", "a 1 b -> a b"]:
        assert str(parse_annotation(text)) == text


def test_parse_rejects_bad_identifier():
    with pytest.raises(AnnotationError, match="bad dim identifier"):
        parse_annotation("a-b -> a")


def test_bind_expands_star_and_checks_output_shape():
    bound = bind_annotation(parse_annotation("* k+, n k+ -> * n"), [(2, 3, 8), (5, 8)], [(2, 3, 5)])
    assert bound.sizes == {"_s0": 2, "_s1": 3, "k": 8, "n": 5}
    with pytest.raises(AnnotationError, match="infers output 0 shape"):
        bind_annotation(parse_annotation("* k+, n k+ -> * n"), [(2, 8), (5, 8)], [(2, 6)])
    with pytest.raises(AnnotationError, match="should have size"):
        bind_annotation(parse_annotation("a k, b k -> a b"), [(2, 8), (5, 7)], [(2, 5)])


def test_split_layouts_column_row_and_strided():
    bound = bind_annotation(parse_annotation("* k+, n k+ -> * n"), [(4, 8), (6, 8)], [(4, 6)])
    col = split_layouts(bound, "n", 2)
    assert col.inputs == [Replicate(), Shard(0)] and col.outputs == [Shard(1)]
    row = split_layouts(bound, "k", 2)
    assert row.inputs == [Shard(1), Shard(1)] and row.outputs == [Partial()]
    assert "do not divide" in split_layouts(bound, "n", 4)
    chunks = bind_annotation(parse_annotation("a (3 c) -> a c, a c, a c"), [(2, 12)], [(2, 4)] * 3)
    assert split_layouts(chunks, "c", 2).inputs == [Shard(1, blocks=3)]
    assert split_candidates(chunks, 2) == ["a", "c"]


def test_every_zoo_op_is_annotated_and_matches_traced_shapes(zoo_graphs):
    """annotate_node binds each annotation to the node's traced shapes and checks the outputs it infers."""
    for name, (graph, _, _) in zoo_graphs.items():
        missing = [n.op for n in graph.nodes if annotate_node(n, graph) is None]
        assert not missing, f"{name}: ops without annotation: {sorted(set(missing))}"


def test_annotation_mismatch_names_node_and_source(zoo_graphs):
    from nnscaler.graph.ops import registry

    graph = zoo_graphs["gpt"][0]
    node = next(n for n in graph.nodes if n.op == "aten.linear.default")
    original = registry.get_rule(node.op)
    registry.register_rule(registry.OpRule(node.op, lambda call: "a b, c b -> a a", "linear"))
    try:
        with pytest.raises(TraceError, match=node.name):
            annotate_node(node, graph)
    finally:
        registry.register_rule(original)
