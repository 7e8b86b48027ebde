"""Repeated layers: instances of the pivot class (e.g. every decoder layer) with identical op
sequences and shapes are folded onto the first one, so the search solves one layer and reuses
the answer (TePDist's idea)."""

from __future__ import annotations

from dataclasses import dataclass, field

from nnscaler.errors import PlanError
from nnscaler.graph.ir import Graph
from nnscaler.policies.autodist.memo import graph_memo
from nnscaler.policies.staging import default_pivots, pivot_starts

__all__ = ["LayerFold", "fold_layers", "layer_instances"]


@dataclass
class LayerFold:
    """Node name -> representative node name, and how many nodes each representative stands for."""

    rep: dict[str, str] = field(default_factory=dict)
    count: dict[str, int] = field(default_factory=dict)
    instances: list[tuple[str, list[int]]] = field(default_factory=list)
    """(module path, node indices) of every layer instance, in graph order."""
    pivots: tuple[str, ...] = ()

    def represented(self) -> list[str]:
        """Representative node names in graph order."""
        return list(self.count)


def layer_instances(
    graph: Graph, pivots: tuple[str, ...] | None = None
) -> tuple[tuple[str, ...], list[tuple[str, list[int]]]]:
    """The pivot classes and every instance's (path, node indices); ((), []) when none are found.
    Once per graph and pivots (a search asks for every configuration it scores)."""
    memo = graph_memo(graph).setdefault("layer_instances", {})
    key = tuple(pivots) if pivots else None
    if key not in memo:
        memo[key] = _layer_instances(graph, pivots)
    pivots_found, instances = memo[key]
    return pivots_found, [(path, list(idx)) for path, idx in instances]


def _layer_instances(graph: Graph, pivots: tuple[str, ...] | None):
    if pivots:  # the user's pivots: a name that matches nothing is their mistake, said as such
        pivots = tuple(pivots)
        starts = pivot_starts(graph, pivots)
    else:
        try:
            pivots = default_pivots(graph)
        except PlanError:  # no repeated layers: nothing to fold, no pipeline boundaries
            return (), []
        starts = pivot_starts(graph, pivots)
    members: dict[str, list[int]] = {path: [] for _, path in starts}
    for i, n in enumerate(graph.nodes):  # one pass: a node belongs to every instance its path starts with
        parts = n.module_path.split(".") if n.module_path else []
        for k in range(1, len(parts) + 1):
            prefix = ".".join(parts[:k])
            if prefix in members:
                members[prefix].append(i)
    return pivots, [(path, members[path]) for _, path in starts]


def _signature(graph: Graph, idx: list[int]) -> tuple:
    sig = []
    for i in idx:
        n = graph.nodes[i]
        ins = tuple(graph.values[r].meta.shape for r in n.input_names() if graph.values[r].meta is not None)
        outs = tuple(graph.values[o].meta.shape if graph.values[o].meta else None for o in n.outputs)
        sig.append((n.op, ins, outs))
    return tuple(sig)


def fold_layers(graph: Graph, pivots: tuple[str, ...] | None = None, enabled: bool = True) -> LayerFold:
    """Fold repeated layer instances onto their first instance (identity when `enabled` is False).

    Kept in the graph's memo (memo.py): a search folds the same graph dozens of times.
    """
    folds = graph_memo(graph).setdefault("fold_layers", {})
    key = (tuple(pivots) if pivots else None, enabled)
    if key not in folds:
        folds[key] = _fold(graph, pivots, enabled)
    return folds[key]


def _fold(graph: Graph, pivots: tuple[str, ...] | None, enabled: bool) -> LayerFold:
    fold = LayerFold()
    pivots, instances = layer_instances(graph, pivots) if enabled else ((), [])
    fold.instances, fold.pivots = instances, pivots
    first_of: dict[tuple, list[int]] = {}
    for _, idx in instances:
        sig = _signature(graph, idx)
        base = first_of.setdefault(sig, idx)
        for i, j in zip(idx, base):
            fold.rep[graph.nodes[i].name] = graph.nodes[j].name
    for n in graph.nodes:
        r = fold.rep.setdefault(n.name, n.name)
        fold.count[r] = fold.count.get(r, 0) + 1
    return fold
