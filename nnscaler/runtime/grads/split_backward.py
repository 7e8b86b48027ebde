"""A stage's backward in two passes, for zero-bubble pipeline schedules: B computes the gradients of
the stage's inputs (what the previous stage waits for) and keeps the graph; W computes the gradients
of the weights later, from the gradients B left at the nodes where the weights' branches join.

The split follows torch.distributed.pipelining (stage_backward_input / stage_backward_weight, whose
graph walk `construct_reverse_graph` / `get_param_groups` we reuse): B runs `torch.autograd.grad`
on the inputs with pre-hooks that record the gradients reaching those join nodes. W differs from
torch's: it runs `torch.autograd.backward` from those nodes into the weights, so the gradients are
accumulated into `.grad` by autograd's own AccumulateGrad nodes and the post-accumulate-grad hooks
of the gradient reducer (overlap, ZeRO buckets) fire as in a plain backward. Weights whose branch
never meets the inputs (or a stage whose inputs want no gradient, like the first stage) get theirs
in W straight from the stage's outputs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

# private helpers of torch.distributed.pipelining (stable since torch 2.4; the graph walk only)
from torch.distributed.pipelining._backward import construct_reverse_graph, get_param_groups

__all__ = ["PendingWeights", "backward_inputs", "backward_weights"]


def _node(t: torch.Tensor) -> Node | None:
    """The autograd node of a tensor: its grad_fn, or the AccumulateGrad node of a leaf."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    return t.view_as(t).grad_fn.next_functions[0][0]


@dataclass
class _Group:
    """Weights whose branches join the input path at `nodes`, and the gradients B saw there."""

    params: list[torch.Tensor]
    nodes: list[Node]
    grads: list[tuple[Any, ...] | None]


@dataclass
class PendingWeights:
    """What W needs: the weight groups, and the outputs for weights not reached through them."""

    groups: list[_Group] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)
    output_grads: list[torch.Tensor | None] = field(default_factory=list)
    direct: list[torch.Tensor] | None = None
    """Weights W reaches from the outputs; None: all of them (the inputs wanted no gradient)."""


def backward_inputs(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[Any],
    params: Iterable[torch.Tensor],
) -> PendingWeights:
    """B: set `.grad` of the `inputs` that want one; return what W needs for the weights."""
    pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
    outs, gouts = [o for o, _ in pairs], [g for _, g in pairs]
    wanted = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    if not outs or not wanted:
        return PendingWeights(outputs=outs, output_grads=gouts, direct=None)
    by_node = {_node(p): p for p in params if p.requires_grad}
    reverse = construct_reverse_graph([_node(o) for o in outs])
    found = get_param_groups([_node(x) for x in wanted], list(by_node), reverse)
    groups = [_Group([by_node[n] for n in g["params"]], list(g["intermediates"]), []) for g in found]
    handles = []
    for group in groups:
        group.grads = [None] * len(group.nodes)
        for i, node in enumerate(group.nodes):
            handles.append(node.register_prehook(_recorder(group, i)))
    try:
        dx = torch.autograd.grad(outs, wanted, gouts, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    for x, g in zip(wanted, dx):
        x.grad = g if g is not None else torch.zeros_like(x)
    covered = {id(p) for group in groups for p in group.params}
    direct = [p for n, p in by_node.items() if n in reverse and id(p) not in covered]
    keep = bool(direct)
    return PendingWeights(groups, outs if keep else [], gouts if keep else [], direct)


def _recorder(group: _Group, i: int):
    def hook(grad_outputs):
        group.grads[i] = grad_outputs

    return hook


def backward_weights(pending: PendingWeights) -> None:
    """W: accumulate the weights' gradients into `.grad` (through autograd's AccumulateGrad nodes)."""
    if pending.direct is None:
        if pending.outputs:
            torch.autograd.backward(pending.outputs, pending.output_grads)
        return
    for group in pending.groups:
        edges, seeds = [], []
        for node, recorded in zip(group.nodes, group.grads):
            for i, g in enumerate(recorded or ()):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    seeds.append(g)
        if not edges:
            continue
        # a join node below another would get its gradient twice: pin each to what B recorded there
        handles = (
            [n.register_prehook(lambda _g, saved=r: saved) for n, r in zip(group.nodes, group.grads)]
            if len(group.nodes) > 1
            else []
        )
        try:
            torch.autograd.backward(edges, seeds, retain_graph=True, inputs=group.params)
        finally:
            for h in handles:
                h.remove()
    if pending.direct:
        torch.autograd.backward(pending.outputs, pending.output_grads, inputs=pending.direct)
