"""Facts of a graph that no plan changes, computed once per graph: a search costs every node once per
configuration it scores, dozens of times."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

from nnscaler.graph.ir import Graph, graph_fact
from nnscaler.policies.plan import NodePlan

__all__ = ["graph_memo", "tp_policy_nodes", "solution_cache", "solution_caches_off", "context_key"]

_SOLUTIONS_CACHED = [True]


def graph_memo(graph: Graph) -> dict:
    """A dict for such facts (node choices, layer folds, the dataflow and its cuts, the tp policy's
    splits), one per graph object and kept outside it (nnscaler.graph.ir.facts): a different graph,
    even one with as many nodes, starts afresh."""
    return graph_fact(graph, "autodist", lambda _: {})


def tp_policy_nodes(graph: Graph, tp: int) -> dict[str, NodePlan]:
    """The tp policy's (Megatron's) splits over `tp` devices, once per graph and degree: the search's
    Megatron alternatives and every standard recipe of that degree read them."""
    from nnscaler.config import ComputeConfig
    from nnscaler.policies.tp import pas_tp  # the tp policy imports autodist's neighbours: not at import

    memo = graph_memo(graph).setdefault("tp_policy_nodes", {})
    if tp not in memo:
        memo[tp] = pas_tp(graph, ComputeConfig(tp, tp)).nodes
    return memo[tp]


def solution_cache(graph: Graph, name: str) -> dict | None:
    """The graph's cache `name` of SPMD problems or solutions (spmd.py: keyed by everything a program
    is made of), or None while solution_caches_off()."""
    return graph_memo(graph).setdefault(name, {}) if _SOLUTIONS_CACHED[0] else None


@contextmanager
def solution_caches_off() -> Iterator[None]:
    """Build and solve every SPMD program afresh inside (tests compare a search with and without)."""
    _SOLUTIONS_CACHED[0] = False
    try:
        yield
    finally:
        _SOLUTIONS_CACHED[0] = True


def context_key(ctx) -> tuple:
    """What of a cost context (cost.CostContext) a cached program or cost depends on: all of it, measured
    op times by identity (a dict)."""
    return (replace(ctx, measured=None), id(ctx.measured) if ctx.measured is not None else None)
