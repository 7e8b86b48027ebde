"""Follow a split forward, as layout propagation will, to see where it ends.

A column-parallel linear is only worth it when its sharded output reaches something that reads it
sharded (a row-parallel linear, a loss, the forward's outputs) with no communication on the way:
every op in between must be able to follow the split. `FlowTracer.follow` replays propagation's
choice (`best_follow`) on the ops downstream of one value, in graph order, and reports the first op
that would need the value whole (or on another dim) instead. That op is the reason a split was not
taken; the `tp` policy records it in the plan.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

from nnscaler.graph.ir import Graph, Layout, Node, Partial, Replicate, Shard
from nnscaler.graph.ops import BoundAnno, get_rule, layouts_for, split_layouts
from nnscaler.policies.propagate import PropagationState, best_follow
from nnscaler.policies.weighted import tensor_refs, weighted_op, where

__all__ = ["Flow", "FlowTracer"]

_PASS_FAMILIES = {"elementwise", "attention", "user"}
_PASS_VIEW_RULES = {"reshape", "expand", "permute", "split", "slice_", "cat", "pool", "batch_norm", "index"}
_STOP_OPS = {"aten.softmax.int", "aten._softmax.default", "aten.log_softmax.int", "aten.cumsum.default"}


@dataclass(frozen=True)
class Flow:
    """Where a split value goes: `reached` a consumer that reads it split; `blocker` names the first op
    that would need it whole ('' when none)."""

    reached: bool
    blocker: str = ""

    @property
    def clean(self) -> bool:
        return self.reached and not self.blocker

    @property
    def reason(self) -> str:
        return self.blocker or "no row-parallel linear, loss or output reads it downstream"


class _Overlay(dict):
    """Layouts seen by the replay: the replayed values first, then what propagation placed so far;
    an activation placed by neither (produced later in the graph) counts as replicated."""

    def __init__(self, replay: dict[str, Layout], placed: dict[str, Layout], graph: Graph):
        super().__init__()
        self.replay, self.placed, self.graph = replay, placed, graph

    def get(self, name: str, default=None):
        if name in self.replay:
            return self.replay[name]
        if name in self.placed:
            return self.placed[name]
        return None if self.graph.values[name].kind in ("param", "buffer") else Replicate()

    def __contains__(self, name: object) -> bool:
        return name in self.replay or name in self.placed


class FlowTracer:
    """Replays layout propagation downstream of one value (see the module docstring)."""

    def __init__(
        self, graph: Graph, ways: int, annotate: Callable[[Node], BoundAnno | None], limit: int = 96
    ):
        self.graph, self.ways, self.annotate, self.limit = graph, ways, annotate, limit
        self.nodes = graph.nodes
        self.order = {n.name: i for i, n in enumerate(graph.nodes)}
        self.consumers = graph.consumers()
        self.outputs = set(graph.output_names())

    def feeds_consumer(self, value: str, limit: int = 64) -> bool:
        """The looser test: does `value` reach a weighted op, a loss or an output through ops that
        could carry a split (elementwise, attention, views), whatever the dims? Worth a column split
        with its output gathered (Megatron's `gather_output`) when no split flows cleanly."""
        seen, frontier = set(), [value]
        while frontier and len(seen) < limit:
            name = frontier.pop()
            if name in seen:
                continue
            seen.add(name)
            if name in self.outputs:
                return True
            for node in self.consumers.get(name, []):
                rule = get_rule(node.op)
                if weighted_op(self.graph, node) is not None or (rule is not None and rule.family == "loss"):
                    return True
                passes = (
                    rule is not None
                    and node.op not in _STOP_OPS
                    and (rule.family in _PASS_FAMILIES or rule.annotate.__name__ in _PASS_VIEW_RULES)
                )
                if passes:
                    frontier.extend(node.outputs)
        return False

    def follow(self, state: PropagationState, value: str, layout: Layout) -> Flow:
        """Where `value`, laid out as `layout`, flows under propagation from `state` on."""
        replay: dict[str, Layout] = {value: layout}
        view = PropagationState(self.graph, self.ways, _Overlay(replay, state.layouts, self.graph))
        heap: list[tuple[int, str]] = []
        seen: set[str] = set()
        reached = value in self.outputs

        def push(name: str) -> None:
            for node in self.consumers.get(name, []):
                if node.name not in seen:
                    seen.add(node.name)
                    heapq.heappush(heap, (self.order[node.name], node.name))  # graph order

        push(value)
        steps = 0
        while heap:
            node = self.nodes[heapq.heappop(heap)[0]]
            steps += 1
            if steps > self.limit:
                return Flow(
                    reached, "" if reached else f"no row-parallel linear or loss within {self.limit} ops"
                )
            outcome = self._step(view, replay, node)
            if isinstance(outcome, str):
                return Flow(reached, outcome)
            if outcome is True:
                reached = True
                continue
            for out in outcome:
                reached = reached or out in self.outputs
                push(out)
        return Flow(reached)

    def _step(self, view: PropagationState, replay: dict[str, Layout], node: Node) -> bool | list[str] | str:
        """One op reading replayed values: True when it consumes them split (done), the outputs it
        passes the split on to, or why it cannot follow."""
        rule = get_rule(node.op)
        if rule is not None and rule.family == "loss":
            return True
        bound = self.annotate(node)
        if bound is None:
            return f"{where(node)} has no annotation: it runs whole"
        w = weighted_op(self.graph, node)
        if w is not None and w.x in replay and w.k in bound.sizes and w.n in bound.sizes:
            have = replay[w.x]
            if not w.reads_row_parallel(have):
                return f"{where(node)} gets it {_describe(have)}, not split on its input features"
            err = split_layouts(bound, w.k, self.ways)
            return (
                True if not isinstance(err, str) else f"{where(node)} cannot split its input features: {err}"
            )
        plan = best_follow(view, node, bound, False)
        lay = layouts_for(bound, rule, plan.split, self.ways if plan.split else 1, plan.blocks)
        if isinstance(lay, str):
            return f"{where(node)}: {lay}"
        for ref, need, anno in zip(tensor_refs(self.graph, node), lay.inputs, bound.anno.inputs):
            have = replay.get(ref.name)
            if have is not None and (need or Replicate()) != have:
                if (
                    isinstance(have, Shard)
                    and anno.dims
                    and bound.anno.flag_of(anno.dims[have.dim].ids[-1]) == "^"
                ):
                    return f"{where(node)} needs dim {have.dim} of it whole ('{anno}'), which the split cuts"
                return f"{where(node)} needs it {_describe(need)} but gets it {_describe(have)}"
        passed = []
        for out, olay in zip(node.outputs, lay.outputs):
            if isinstance(olay, (Shard, Partial)):
                replay[out] = olay
                passed.append(out)
        return passed or True


def _describe(layout: Layout | None) -> str:
    if layout is None or isinstance(layout, Replicate):
        return "whole"
    if isinstance(layout, Shard):
        return f"split on dim {layout.dim}" + (f" in {layout.blocks} blocks" if layout.blocks > 1 else "")
    if isinstance(layout, Partial):
        return "as partial sums"
    return str(layout)
