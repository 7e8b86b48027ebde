"""Facts of a graph that no plan changes, computed once per graph: a search costs every node once per
configuration it scores, dozens of times."""

from __future__ import annotations

from nnscaler.graph.ir import Graph

__all__ = ["graph_memo"]


def graph_memo(graph: Graph) -> dict:
    """A dict kept on the graph for such facts (node choices, layer folds, the dataflow and its cuts,
    the tp policy's splits). Kept with the node count: a graph that gains or loses nodes starts afresh."""
    cached = getattr(graph, "_autodist_memo", None)
    if cached is None or cached[0] != len(graph.nodes):
        cached = (len(graph.nodes), {})
        graph._autodist_memo = cached
    return cached[1]
