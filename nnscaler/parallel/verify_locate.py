"""Where the captured program first parts from eager: a module, a graph node, a lost write.

Heuristic, in two steps (used only once the outputs or gradients are known to differ):

1. Module boundaries. A module's region is the graph nodes whose module path is the module's or
   lies below it. The values entering the region (read there, computed outside: activations and
   forward inputs) are matched to the tensors eager passed the module (forward pre-hooks), the values
   leaving it (read outside, or forward outputs) to what it returned (forward hooks). A value
   matches when some eager tensor of the same shape and dtype, from any call of the module, is
   within tolerance; it differs when there are such tensors and none is. Of all differing boundary
   values, the one computed first (graph order) wins; the module reported is that of the node that
   computed it. Nodes whose module path does not name a module eager ran are left out.
2. Source lines inside that module. Eager runs once more with every torch call inside the module
   recorded by the user source line it comes from (the innermost frame outside torch, as capture
   names a node's line). The values leaving each line's run of nodes are matched against the
   tensors eager produced on that line: the first that differs names the first differing node.
   An in-place write eager made on a line for which the module's region has no node at all is
   reported as a write capture may have lost.
"""

from __future__ import annotations

import linecache
from dataclasses import dataclass, field

import torch

from nnscaler.graph.ir import Graph, Node
from nnscaler.parallel.verify_compare import Difference, difference
from nnscaler.parallel.verify_runs import Call, line_key

__all__ = ["Finding", "first_module", "first_node", "lost_writes"]


@dataclass
class Finding:
    """The first differing value: the node computing it, and which module boundary showed it."""

    value: str
    node: Node
    index: int
    where: str
    diff: Difference
    lost: list[str] = field(default_factory=list)
    line_node: Node | None = None
    line_diff: Difference | None = None


def _region(graph: Graph, path: str) -> list[int]:
    prefix = path + "."
    return [
        i
        for i, n in enumerate(graph.nodes)
        if not path or n.module_path == path or n.module_path.startswith(prefix)
    ]


def _compare(got: object, candidates: list[torch.Tensor]) -> Difference | None | str:
    """None: matches a candidate; a Difference: differs from all of them; 'unknown': no candidate."""
    if not isinstance(got, torch.Tensor):
        return "unknown"
    same = [c for c in candidates if c.shape == got.shape and c.dtype == got.dtype]
    if not same:
        return "unknown"
    diffs = [difference(got, c) for c in same]
    if any(d is None for d in diffs):
        return None
    return min(diffs, key=lambda d: d.max_abs)


def _boundaries(graph: Graph, region: list[int], index: dict[str, int]) -> tuple[list[str], list[str]]:
    """(values entering the region, values leaving it), each in graph order."""
    inside = {graph.nodes[i].name for i in region}
    entering: dict[str, None] = {}
    produced: list[str] = []
    for i in region:
        node = graph.nodes[i]
        for name in node.input_names():
            v = graph.values[name]
            if v.kind in ("activation", "input") and (v.producer is None or v.producer not in inside):
                entering[name] = None
        produced.extend(node.outputs)
    outside_reads = {name for n in graph.nodes if n.name not in inside for name in n.input_names()} | set(
        graph.output_names()
    )
    leaving = [v for v in produced if v in outside_reads]
    return sorted(entering, key=lambda v: index.get(v, -1)), leaving


def first_module(
    graph: Graph,
    values: dict[str, object],
    seen: dict[str, object],
) -> Finding | None:
    """Step 1: the first value at a module boundary that differs from eager (None: none found)."""
    producer = {out: i for i, n in enumerate(graph.nodes) for out in n.outputs}
    best: Finding | None = None
    for path, record in seen.items():
        if not path:
            continue
        region = _region(graph, path)
        if not region:
            continue
        entering, leaving = _boundaries(graph, region, producer)
        for names, eager, side in ((entering, record.inputs, "input"), (leaving, record.outputs, "output")):
            candidates = [t for call in eager for t in call]
            for name in names:
                i = producer.get(name)
                if i is None or (best is not None and i >= best.index) or name not in values:
                    continue
                diff = _compare(values[name], candidates)
                if isinstance(diff, Difference):
                    where = f"an {side} of `{path}` ({graph.module_classes.get(path, '?')})"
                    best = Finding(name, graph.nodes[i], i, where, diff)
    return best


def _line_text(call: Call) -> str:
    file, _, line = call.line.rpartition(":")
    text = linecache.getline(call.path, int(line)).strip() if line.isdigit() else ""
    return f"{call.line}  {text}" if text else call.line


def first_node(
    graph: Graph, values: dict[str, object], path: str, calls: list[Call]
) -> tuple[Node, Difference] | None:
    """Step 2: the first node of module `path`'s region whose value leaving its source line differs
    from every tensor eager made on that line."""
    region = _region(graph, path)
    by_line: dict[str, list[torch.Tensor]] = {}
    for call in calls:
        by_line.setdefault(call.line, []).extend(call.tensors)
    lines = {graph.nodes[i].name: line_key(graph.nodes[i].source) for i in region}
    readers: dict[str, set[str]] = {}
    for n in graph.nodes:
        for name in n.input_names():
            readers.setdefault(name, set()).add(lines.get(n.name, "<outside>"))
    outputs = set(graph.output_names())
    for i in region:
        node = graph.nodes[i]
        here = lines[node.name]
        for out in node.outputs:
            if out not in values or not (readers.get(out, set()) - {here} or out in outputs):
                continue  # read only on its own line: an intermediate eager never shows
            diff = _compare(values[out], by_line.get(here, []))
            if isinstance(diff, Difference):
                return node, diff
    return None


def lost_writes(graph: Graph, path: str, calls: list[Call]) -> list[str]:
    """In-place writes eager made inside module `path` on lines where its region has no node."""
    lines = {line_key(graph.nodes[i].source) for i in _region(graph, path)}
    found: dict[str, None] = {}
    for call in calls:
        if call.wrote and call.line and call.line not in lines:
            found[_line_text(call)] = None
    return list(found)
