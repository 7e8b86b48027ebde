"""Facts derived from a graph (consumer maps, node indexes, a search's per-node choices), cached per
graph object and kept outside it.

A Graph is immutable and hashes by identity (`eq=False`), so a WeakKeyDictionary keyed by the graph
itself is exact: a fact computed for one graph is never served for another (not even an equal copy,
or one with the same node count), and the facts go away with their graph. Identity rather than
structural equality because hashing thousands of nodes on every look-up would cost more than most
facts do to compute.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from nnscaler.graph.ir.graph import Graph

__all__ = ["graph_facts", "graph_fact"]

T = TypeVar("T")

_FACTS: weakref.WeakKeyDictionary[Graph, dict[str, Any]] = weakref.WeakKeyDictionary()


def graph_facts(graph: Graph) -> dict[str, Any]:
    """The facts cached for `graph` (name -> fact), empty for a graph not seen before.

    Callers name their facts with distinct keys (`setdefault`) and store only what follows from the
    graph alone: anything that also depends on an argument (a degree, a mesh) goes under a key that
    includes it, or in a dict keyed by it. A fact must not hold the graph itself (that would keep
    the graph, and its facts, alive).
    """
    facts = _FACTS.get(graph)
    if facts is None:
        facts = _FACTS[graph] = {}
    return facts


def graph_fact(graph: Graph, key: str, compute: Callable[[Graph], T]) -> T:
    """`compute(graph)`, computed once per graph and cached under `key`."""
    facts = graph_facts(graph)
    if key not in facts:
        facts[key] = compute(graph)
    return facts[key]
