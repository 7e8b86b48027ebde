"""What crosses a pipeline stage boundary: the activations produced before a cut of the node order
and read after it. Not only the layer's input: skip connections, rotary tables, masks and forward
inputs read by later stages all travel (and, with recompute, are what a stage keeps).

The dataflow is a networkx MultiDiGraph (one edge per value read, keyed by the value's name) and the
crossing values of a cut are its edge boundary (networkx.edge_boundary) between the nodes before and
after the cut.
"""

from __future__ import annotations

import networkx as nx

from nnscaler.graph.ir import Graph
from nnscaler.policies.autodist.memo import graph_memo

__all__ = ["dataflow_graph", "crossing_values"]

_INPUT = "input:"
"""Prefix of the source vertex of a forward input (inputs are not produced by a node)."""


def dataflow_graph(graph: Graph) -> nx.MultiDiGraph:
    """Vertices: node names and one source per forward input; an edge producer -> reader per activation
    or input read (parameters and buffers live on their stage and never travel). Once per graph
    (memo.py)."""
    memo = graph_memo(graph)
    if "dataflow" in memo:
        return memo["dataflow"]
    g = nx.MultiDiGraph()
    for i, node in enumerate(graph.nodes):
        g.add_node(node.name, order=i)
    for node in graph.nodes:
        for ref in set(node.input_names()):
            value = graph.values[ref]
            if value.kind in ("param", "buffer") or value.meta is None:
                continue
            src = value.producer if value.producer in g else _INPUT + ref
            if src not in g:
                g.add_node(src, order=-1)
            g.add_edge(src, node.name, key=ref)
    memo["dataflow"] = g
    return g


def crossing_values(graph: Graph, index: int) -> tuple[str, ...]:
    """Names of the tensors that cross the cut before node `index` (sorted, each once). Cached per
    graph: a search asks for the same cuts for every configuration it scores."""
    g = dataflow_graph(graph)
    cache = graph_memo(graph).setdefault("crossing", {})
    if index not in cache:
        order = nx.get_node_attributes(g, "order")
        before = {n for n, i in order.items() if i < index}
        after = set(g) - before
        cache[index] = tuple(sorted({key for _, _, key in nx.edge_boundary(g, before, after, keys=True)}))
    return cache[index]
