"""Which weights a plan keeps whole on every device, and why: the compile summary lists the largest.

A parameter is stored as its first reader needs it (see nnscaler.partition), so the reason it stays
whole is that reader's: the note the policy wrote when it decided (e.g. `tp`'s "kept whole: output
features (size 7) cannot be split 2 ways", or the op that needed a split output whole), or, for an
op that only follows its inputs, that nothing it reads is split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nnscaler.graph.ir import Graph, Node, Replicate
from nnscaler.graph.ops import annotate_node, get_rule, is_bias_split
from nnscaler.partition.program import LocalTensor
from nnscaler.policies.weighted import where

__all__ = ["UnsplitWeight", "unsplit_weights", "unsplit_summary"]


@dataclass(frozen=True)
class UnsplitWeight:
    """A parameter every device of a tensor-parallel group holds whole."""

    name: str
    """Its state-dict name."""
    nbytes: int
    share: float
    """Its fraction of the model's parameter bytes."""
    reason: str


def unsplit_weights(graph: Graph, plan, tensors: list[LocalTensor], top: int = 5) -> list[UnsplitWeight]:
    """The `top` largest parameters `tensors` (the partitioned program's) hold whole, largest first."""
    params = {t.name: t for t in tensors if t.is_param}
    total = sum(_nbytes(t) for t in params.values()) or 1
    whole = sorted(
        (t for t in params.values() if isinstance(t.layout, Replicate)), key=lambda t: (-_nbytes(t), t.name)
    )
    consumers = graph.consumers()
    return [
        UnsplitWeight(
            t.original_name, _nbytes(t), _nbytes(t) / total, _reason(graph, plan, consumers, t.name)
        )
        for t in whole[:top]
    ]


def unsplit_summary(weights: list[UnsplitWeight]) -> str:
    """One line per weight: name, size, share of the parameters, reason."""
    if not weights:
        return "every weight is split"
    lines = [f"  {w.name} ({_size(w.nbytes)}, {w.share:.1%} of the parameters): {w.reason}" for w in weights]
    return "largest weights kept whole on every device:\n" + "\n".join(lines)


def _reason(graph: Graph, plan, consumers: dict[str, list[Node]], name: str) -> str:
    readers = consumers.get(name, [])
    if not readers:
        return "no op reads it"
    node = readers[0]  # the first reader decides how it is stored
    np = plan.node(node.name)
    view = None
    # a view of the weight (`w.T`, `w.split(...)`) kept whole: the reason is its reader's
    while not np.is_split and len(node.input_names()) == 1 and consumers.get(node.outputs[0]):
        view = view or node
        node = consumers[node.outputs[0]][0]
        np = plan.node(node.name)
    if np.note and not np.is_split:
        return np.note
    bound = annotate_node(node, graph)
    rule = get_rule(node.op)
    if bound is None:
        return f"{where(node)} has no annotation: it runs whole on every device"
    if np.is_split and view is not None:
        return (
            f"read through {where(view)}, which cannot be split: stored whole, and each device slices "
            f"the part {where(node)} needs at every step"
        )
    if np.is_split:
        if is_bias_split(bound, rule, np.split, np.ways):
            return f"bias of {where(node)}, split on its input features: added once after the all-reduce"
        return f"{where(node)} is split on '{np.describe()}', a dim this weight does not have"
    if rule is not None and rule.family == "norm":
        return f"{where(node)} normalises its input whole (nothing it reads is split)"
    return f"{where(node)} runs whole: nothing it reads is split, and the policy did not split it"


def _nbytes(t: LocalTensor) -> int:
    n = 1
    for s in t.full_shape:
        n *= s
    return n * getattr(torch, t.dtype).itemsize


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
