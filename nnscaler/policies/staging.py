"""Where pipeline stages start: at module boundaries (pivots, e.g. every decoder layer), chosen so the
stages' estimated compute is as even as possible, or at module paths the user names."""

from __future__ import annotations

from collections import Counter

from nnscaler.errors import PlanError
from nnscaler.graph.ir import Graph, Node

__all__ = [
    "parse_pivots",
    "default_pivots",
    "pivot_starts",
    "node_cost",
    "balanced_starts",
    "explicit_starts",
]

_CONTRACTING = {  # ops whose cost is (output elements) x (contracted length, the last dim of input 0)
    "aten.linear.default",
    "aten.mm.default",
    "aten.bmm.default",
    "aten.matmul.default",
    "aten.addmm.default",
    "aten.baddbmm.default",
    "aten.einsum.default",
}


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


def node_cost(node: Node, graph: Graph) -> float:
    """Rough forward FLOPs: contractions count output x contracted length, everything else its outputs."""
    out = sum(graph.values[o].meta.numel for o in node.outputs if graph.values[o].meta is not None)
    if node.op in _CONTRACTING or node.op.startswith("aten.scaled_dot_product_attention"):
        ins = [graph.values[n].meta for n in node.input_names() if graph.values[n].meta is not None]
        if ins and ins[0].shape:
            k = ins[0].shape[-1]
            if node.op.startswith("aten.scaled_dot_product_attention") and len(ins) > 1:
                k = ins[1].shape[-2] * 2  # q @ k^T and attn @ v
            return 2.0 * out * k
    if node.op.startswith("aten.convolution"):
        w = graph.values[node.input_names()[1]].meta
        return 2.0 * out * (w.numel // max(w.shape[0], 1))
    return float(out)


def balanced_starts(graph: Graph, candidates: list[int], nstages: int) -> list[int]:
    """Stage starts from `candidates` (node indices; 0 is always a start) minimising the costliest stage."""
    cands = sorted(set([0] + candidates))
    if nstages > len(cands):
        raise PlanError(
            f"pipeline_nstages={nstages} but the model has only {len(cands)} places a stage can start (the "
            "graph's start and each pivot module): use fewer stages or finer pipeline_pivots"
        )
    prefix = [0.0]
    for node in graph.nodes:
        prefix.append(prefix[-1] + node_cost(node, graph))
    ends = cands[1:] + [len(graph.nodes)]

    def cost(i: int, j: int) -> float:  # stage covering candidates i .. j-1
        return prefix[ends[j - 1]] - prefix[cands[i]]

    k = len(cands)
    inf = float("inf")
    # best[s][j]: the least max-cost of splitting candidates[0:j] into s stages
    best = [[inf] * (k + 1) for _ in range(nstages + 1)]
    cut = [[0] * (k + 1) for _ in range(nstages + 1)]
    best[0][0] = 0.0
    for s in range(1, nstages + 1):
        for j in range(s, k + 1):
            for i in range(s - 1, j):
                v = max(best[s - 1][i], cost(i, j))
                if v < best[s][j]:
                    best[s][j], cut[s][j] = v, i
    starts, j = [], k
    for s in range(nstages, 0, -1):
        i = cut[s][j]
        starts.append(cands[i])
        j = i
    return sorted(starts)


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
