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
    """Names of the tensors that cross the cut before node `index` (sorted, each once): the edge
    boundary of the dataflow between the nodes before `index` and the others. Every cut at once,
    once per graph (a search asks for thousands of cuts: one boundary of Llama-3-405B's dataflow
    took 8 ms)."""
    cuts = graph_memo(graph).get("crossing_cuts")
    if cuts is None:
        cuts = graph_memo(graph)["crossing_cuts"] = _all_cuts(graph)
    return cuts[index] if 0 <= index < len(cuts) else ()


def _all_cuts(graph: Graph) -> list[tuple[str, ...]]:
    """Per cut index, the values with an edge across it: produced before it (a forward input: before
    every cut) and read at or after it, i.e. producer order < index <= last reader's order; one sweep
    of the node order adding each value after its producer and dropping it after its last reader."""
    g = dataflow_graph(graph)
    order = nx.get_node_attributes(g, "order")
    born: dict[str, int] = {}
    last: dict[str, int] = {}
    for src, dst, ref in g.edges(keys=True):
        born[ref] = order[src]
        last[ref] = max(last.get(ref, -1), order[dst])
    starts: dict[int, list[str]] = {}
    ends: dict[int, list[str]] = {}
    for ref, p in born.items():
        if last[ref] > p:
            starts.setdefault(p + 1, []).append(ref)  # crosses cuts p + 1 .. last
            ends.setdefault(last[ref] + 1, []).append(ref)
    live: set[str] = set()
    cuts = []
    for index in range(len(graph.nodes) + 1):
        live.difference_update(ends.get(index, ()))
        live.update(starts.get(index, ()))
        cuts.append(tuple(sorted(live)))
    return cuts
