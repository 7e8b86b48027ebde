"""Facts of a graph that no plan changes, computed once per graph: a search costs every node once per
configuration it scores, dozens of times."""

from __future__ import annotations

from nnscaler.graph.ir import Graph, graph_fact

__all__ = ["graph_memo"]


def graph_memo(graph: Graph) -> dict:
    """A dict for such facts (node choices, layer folds, the dataflow and its cuts, the tp policy's
    splits), one per graph object and kept outside it (nnscaler.graph.ir.facts): a different graph,
    even one with as many nodes, starts afresh."""
    return graph_fact(graph, "autodist", lambda _: {})
