"""The report's per-module splits in words: which dimension of each module's ops is split over which
axis (tp or a 2-D mesh's axes, dp, pp), how many devices the axis has and whether its group stays
inside a node (the same rank placement the cost model assumes: cluster.link, CostContext.axis_link)."""

from __future__ import annotations

import math
import re
from collections import Counter

from nnscaler.graph.ir import Graph, Node
from nnscaler.graph.ops import annotate_node
from nnscaler.policies.autodist.cluster import ClusterSpec, LinkSpec
from nnscaler.policies.autodist.context import PlannerSetup
from nnscaler.policies.autodist.layers import layer_instances
from nnscaler.policies.plan import NodePlan, Plan

__all__ = ["module_group", "module_words", "short_op"]

_OPS = {"scaled_dot_product_attention": "attention"}
_NAMED = {"linear", "attention", "embedding", "layer_norm", "rms_norm", "group_norm"}
"""Ops the report names; the others are counted as 'split to match'."""
_WORDS = {
    ("linear", "n"): "output features",
    ("linear", "k"): "input features",
    ("attention", "h"): "heads",
    ("attention", "g"): "key/value head groups",
    ("embedding", "d"): "hidden dim",
    ("embedding", "v"): "vocabulary",
}


def short_op(op: str) -> str:
    parts = op.split(".")
    return parts[1] if op.startswith("aten.") and len(parts) > 2 else op


def module_group(graph: Graph, pivots) -> dict[str, str]:
    """Node name -> the module it is reported under: its layer instance, else a two-level path."""
    _, instances = layer_instances(graph, pivots)
    out = {}
    for path, idx in instances:
        for i in idx:
            out[graph.nodes[i].name] = path
    for n in graph.nodes:
        if n.name not in out:
            out[n.name] = ".".join(n.module_path.split(".")[:2]) or "(top level)"
    return out


def _where(cluster: ClusterSpec, link: LinkSpec) -> str:
    return "intra-node" if link is cluster.intra_node else "inter-node"


def _stage_axes(plan: Plan, cluster: ClusterSpec) -> list[str]:
    """Each mesh axis of a stage as 'name (size, intra-node|inter-node)'."""
    cp = "cp" if plan.context_parallel else ""  # the sequence's axis (mesh axis 0, or all devices)
    if plan.mesh:
        return [
            f"{cp if k == 0 and cp else f'axis {k}'} "
            f"({size}, {_where(cluster, cluster.link(size, math.prod(plan.mesh[k + 1 :])))})"
            for k, size in enumerate(plan.mesh)
        ]
    return [f"{cp or 'tp'} ({plan.tp_size}, {_where(cluster, cluster.link(plan.tp_size))})"]


def _dim_word(graph: Graph, node: Node, ident: str) -> str:
    """A split dimension in words: the annotation's name for it, else its place in the first input."""
    word = _WORDS.get((_OPS.get(short_op(node.op), short_op(node.op)), ident))
    bound = annotate_node(node, graph) if word is None else None
    if bound is None or not bound.anno.inputs:
        return word or f"dim {ident}"
    dims = bound.anno.inputs[0].dims or ()
    i = next((k for k, d in enumerate(dims) if ident in d.ids), None)
    if i is None:
        return f"dim {ident}"
    if len(dims) >= 3 and i in (0, len(dims) - 2):
        return "batch" if i == 0 else "sequence"
    return "rows" if i == 0 else f"dim {i}"


def _phrases(graph: Graph, node: Node, p: NodePlan, axes: list[str]) -> list[tuple[str, str]]:
    """(axis, what is split over it) for each split axis of one op; '' for ops not named in reports."""
    name = _OPS.get(short_op(node.op), short_op(node.op))
    splits = [(s, k) for k, (s, _) in enumerate(p.mesh_splits)] if p.mesh_splits else [(p.split, 0)]
    out = []
    for ident, k in splits:
        if ident is not None and k < len(axes):
            named = name in _NAMED
            out.append((axes[k], f"{name} {_dim_word(graph, node, ident)}" if named else ""))
    return out


def _module_text(phrases: list[tuple[str, str]], batch: str) -> str:
    by_axis: dict[str, Counter] = {}
    for axis, what in phrases:
        by_axis.setdefault(axis, Counter())[what] += 1
    parts = []
    for axis, counts in by_axis.items():
        named = [f"{w} x{n}" if n > 1 else w for w, n in counts.items() if w]
        if counts[""]:
            named.append(f"{counts['']} more op(s) split to match")
        parts.append(f"over {axis}: {', '.join(named)}")
    return "; ".join(parts or ["replicated"]) + batch


def module_words(graph: Graph, plan: Plan, setup: PlannerSetup) -> list[str]:
    """'## Splits in words': one bullet per module, alike consecutive layers folded into one."""
    c = setup.cluster
    axes = _stage_axes(plan, c)
    group = module_group(graph, setup.pivots)
    phrases: dict[str, list[tuple[str, str]]] = {}
    for n in graph.nodes:
        p = plan.node(n.name)
        phrases.setdefault(group[n.name], []).extend(_phrases(graph, n, p, axes) if p.is_split else [])
    dp = setup.dp_size
    batch = f"; batch over dp ({dp}, {_where(c, c.link(dp, setup.plan_ngpus))})" if dp > 1 else ""
    rows: list[list] = []  # [first path, last path, count, text]
    for g, ph in phrases.items():
        text = _module_text(ph, batch)
        if rows and rows[-1][3] == text and _pattern(rows[-1][1]) == _pattern(g) != g:
            rows[-1][1:3] = [g, rows[-1][2] + 1]
        else:
            rows.append([g, g, 1, text])
    lines = ["", "## Splits in words", ""]
    lines.append(
        f"Axes: the {plan.tp_size} device(s) of a stage as {' x '.join(axes)}"
        + (f"; {dp} data-parallel replicas over dp, each taking its share of the batch" if dp > 1 else "")
        + (
            f"; {plan.pipeline.pp_size} pipeline stages over pp "
            f"({_where(c, c.link(2, plan.tp_size))} between neighbours)"
            if plan.pipeline
            else ""
        )
        + "."
    )
    lines.append("")
    for first, last, count, text in rows:
        name = f"`{first}`" if count == 1 else f"`{first}` ... `{last}` ({count} alike)"
        lines.append(f"- {name}: {text}")
    return lines


def _pattern(path: str) -> str:
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "#", path)
