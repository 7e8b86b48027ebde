"""Structural invariants of a Graph, checked between compiler stages in tests."""

from __future__ import annotations

from nnscaler.graph.ir.graph import Graph

__all__ = ["verify"]


def verify(graph: Graph) -> None:
    """Raise AssertionError if a value is read before it is written, written twice, or dangling."""
    defined = {name for name, v in graph.values.items() if v.kind in ("input", "param", "buffer")}
    for node in graph.nodes:
        for name in node.input_names():
            assert name in defined, f"node {node.name} reads {name} before it is defined"
        for out in node.outputs:
            assert out in graph.values, f"node {node.name} writes unknown value {out}"
            assert out not in defined, f"value {out} is written twice (second time by {node.name})"
            assert graph.values[out].producer == node.name, (
                f"value {out} does not name {node.name} as producer"
            )
            defined.add(out)
    for name in graph.output_names():
        assert name in defined, f"graph output {name} is never defined"
    for name in graph.inputs:
        assert graph.values[name].kind == "input", f"graph input {name} is not of kind 'input'"
