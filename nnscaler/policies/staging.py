"""Where pipeline stages may start: at the instances of pivot classes the user names (e.g. every
decoder layer), at the model's blocks (the top-level modules and each layer of a list) and, where
blocks are too coarse to balance, at the modules inside them; or at module paths the user names.
Which of these places become stage starts is stage_balance.py's choice."""

from __future__ import annotations

from collections import Counter

from nnscaler.errors import PlanError
from nnscaler.graph.ir import Graph, graph_fact
from nnscaler.policies.op_cost import graph_costs

__all__ = [
    "parse_pivots",
    "default_pivots",
    "pivot_starts",
    "block_key",
    "candidate_levels",
    "explicit_starts",
]


def parse_pivots(value) -> tuple[str, ...]:
    """`pipeline_pivots` as given in pas_config: 'A,B', ['A', 'B'] or None."""
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        return tuple(v.strip() for v in value.split(",") if v.strip())
    return tuple(str(v) for v in value)


def _instance_paths(path: str) -> list[str]:
    parts = path.split(".") if path else []
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def default_pivots(graph: Graph) -> tuple[str, ...]:
    """The class of the repeated layers: the most common class of modules held in a list (path x.N)."""
    classes: Counter[str] = Counter()
    seen = set()
    for node in graph.nodes:
        for path in _instance_paths(node.module_path):
            if path.rsplit(".", 1)[-1].isdigit() and path not in seen:
                seen.add(path)
                classes[graph.module_classes.get(path, "")] += 1
                break
    classes.pop("", None)
    if not classes:
        raise PlanError(
            "cannot find repeated layers to start pipeline stages at: set pas_config['pipeline_pivots'] to the "
            "class name of the layers (e.g. 'LlamaDecoderLayer')"
        )
    return (classes.most_common(1)[0][0],)


def pivot_starts(graph: Graph, pivots: tuple[str, ...]) -> list[tuple[int, str]]:
    """(node index, module path) where each instance of a pivot class begins, in graph order."""
    out: list[tuple[int, str]] = []
    seen: set[str] = set()
    for i, node in enumerate(graph.nodes):
        inst = next(
            (p for p in _instance_paths(node.module_path) if graph.module_classes.get(p) in pivots), None
        )
        if inst is not None and inst not in seen:
            seen.add(inst)
            out.append((i, inst))
    if not out:
        known = sorted(set(graph.module_classes.values()))
        raise PlanError(
            f"pipeline_pivots {list(pivots)} match no module of the model; its module classes: {known}"
        )
    return out


def explicit_starts(graph: Graph, paths: list[str]) -> list[int]:
    """Node indices where the named modules begin (stages after the first)."""
    out = []
    for path in paths:
        index = next(
            (
                i
                for i, n in enumerate(graph.nodes)
                if n.module_path == path or n.module_path.startswith(path + ".")
            ),
            None,
        )
        if index is None:
            raise PlanError(
                f"pas_config['pipeline_stages'] names module {path!r}, which runs no op in the trace"
            )
        out.append(index)
    if out != sorted(set(out)) or (out and out[0] == 0):
        raise PlanError(
            f"pas_config['pipeline_stages'] {paths} must name modules in the order they run, after the first op"
        )
    return [0] + out


CROSS_FACTOR = 4.0
"""Below the blocks, a stage may start where at most this many times the bytes crossing a typical
block boundary cross (the hidden state and a few of its size, e.g. the residual, a router's gates)."""


def block_key(path: str, depth: int = 0) -> str:
    """The block a node of module `path` belongs to: the path up to its first list index (`layers.3`),
    else its first part (`embed`, `head`; '' for the model's own forward); `depth` more parts below
    that name the modules inside the block."""
    parts = path.split(".") if path else []
    first = next((k for k, p in enumerate(parts) if p.isdigit()), 0 if parts else -1)
    return ".".join(parts[: first + 1 + depth])


def candidate_levels(
    graph: Graph, pivots: tuple[str, ...] = (), whole: tuple[str, ...] = ()
) -> list[tuple[str, list[int]]]:
    """Places a stage may start, coarse to fine, each level a superset of the one before, as (name,
    node indices with 0 first). With `pivots`: only where their instances begin. Otherwise: where the
    block changes, then where the module `depth` parts below the block changes (depth 1, 2, ...),
    then between any two ops. Below the blocks, only places where no single activation crossing is
    larger than the largest one crossing a typical (median) block boundary (the hidden state: never
    where attention scores, an MLP's inner activation or a graph network's per-edge messages would
    cross) and at most CROSS_FACTOR times the bytes crossing there.
    Places where a non-tensor value would cross (stages pass tensors only) or inside a module of
    `whole` (recomputed modules: each is checkpointed in one stage) are left out. Computed once per
    graph, pivots and `whole` (a search asks for every configuration it scores)."""
    memo = graph_fact(graph, "staging.candidate_levels", lambda _: {})
    key = (tuple(pivots), tuple(whole))
    if key not in memo:
        memo[key] = _candidate_levels(graph, tuple(pivots), tuple(whole))
    return [(name, list(cands)) for name, cands in memo[key]]


def _candidate_levels(graph: Graph, pivots: tuple[str, ...], whole: tuple[str, ...]):
    costs = graph_costs(graph)
    inside = _inside_whole(graph, whole)
    if pivots:
        found = [i for i, _ in pivot_starts(graph, pivots) if not inside[i]]
        return [(f"pivots {', '.join(pivots)}", sorted({0, *found}))]
    paths = [n.module_path for n in graph.nodes]
    deepest = max((len(p.split(".")) for p in paths if p), default=0)
    levels: list[tuple[str, list[int]]] = []
    single = total = 0.0

    def small(i: int) -> bool:
        return costs.cross_largest[i] <= single and costs.cross_bytes[i] <= CROSS_FACTOR * total

    for depth in range(deepest + 1):
        keys = [block_key(p, depth) for p in paths]
        found = [
            i for i in range(1, len(paths)) if keys[i] != keys[i - 1] and costs.cuttable[i] and not inside[i]
        ]
        if depth == 0:
            single = _median([costs.cross_largest[i] for i in found])
            total = _median([costs.cross_bytes[i] for i in found])
        else:
            found = [i for i in found if small(i)]
        _add_level(levels, "blocks" if depth == 0 else f"modules {depth} below the blocks", found)
    ops = [i for i in range(1, len(paths)) if costs.cuttable[i] and not inside[i] and small(i)]
    _add_level(levels, "operators", ops)
    return levels


def _inside_whole(graph: Graph, whole: tuple[str, ...]) -> list[bool]:
    """For each node index i: nodes i - 1 and i both run inside one module of `whole` ('' is ignored)."""

    def within(path: str, module: str) -> bool:
        return path == module or path.startswith(module + ".")

    mods = [m for m in whole if m]
    paths = [n.module_path for n in graph.nodes]
    return [False] + [
        any(within(paths[i - 1], m) and within(paths[i], m) for m in mods) for i in range(1, len(paths))
    ]


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2] if xs else 0.0


def _add_level(levels: list[tuple[str, list[int]]], name: str, found: list[int]) -> None:
    cands = sorted({0, *found, *(levels[-1][1] if levels else ())})
    if not levels or cands != levels[-1][1]:
        levels.append((name, cands))
