"""Value checks on computed tensors check each rank's own elements, so no plan gathers a tensor for them.

`assert torch.isfinite(h).all()` reduces `h` to one value; a plan that splits `h` (tp: its features)
would have to gather it whole just to check it. But such a check is a statement about every element:
"raise unless all are true" holds when it holds on each piece. `localize_value_checks` rewrites

    all(B) checked true          -> B checked true element by element
    any(B) checked false         -> B checked false element by element
    logical_not(C)               -> C, checked the other way
    max(X) >= c / > c  (X integer or bool) -> X >= c / > c element by element (and min(X) <= c / < c;
    max(X) < c, min(X) >= c ...  in an assert: the element-wise comparison, checked true)

so the check op reads an element-wise tensor that splits like its producer: each rank checks the
elements it holds and raises if one of them is bad (nnscaler.runtime.checks). Float maxima are left
alone (`max` propagates NaN, an element-wise comparison would not), and so are conditions on the
forward's inputs, which every rank holds whole anyway (checked whole: every rank raises alike).
"""

from __future__ import annotations

import dataclasses

from nnscaler.graph.ir import Graph, Node, Ref
from nnscaler.graph.ops.check import VALUE_CHECK_OP

__all__ = ["localize_value_checks"]

_NOT = "aten.logical_not.default"
_REDUCE = {"aten.all.default": False, "aten.any.default": True}
"""Reduction -> the raise_when under which it can be dropped (all(B) must be true; any(B) false)."""
_EXTREMES = {"aten.max.default", "aten.min.default"}
_COMPARE = {"aten.ge.Scalar", "aten.gt.Scalar", "aten.le.Scalar", "aten.lt.Scalar"}
# (extreme, comparison, raise_when) for which `cmp(extreme(X), c)` checked `raise_when` equals the
# element-wise `cmp(X, c)` checked the same way: a max above c means some element above c, etc.
_ELEMENTWISE = {
    ("aten.max.default", "aten.ge.Scalar", True),
    ("aten.max.default", "aten.gt.Scalar", True),
    ("aten.min.default", "aten.le.Scalar", True),
    ("aten.min.default", "aten.lt.Scalar", True),
    ("aten.max.default", "aten.le.Scalar", False),
    ("aten.max.default", "aten.lt.Scalar", False),
    ("aten.min.default", "aten.ge.Scalar", False),
    ("aten.min.default", "aten.gt.Scalar", False),
}
_FLOATS = ("float", "bfloat16", "half", "complex")


class _Rewrite:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.nodes = list(graph.nodes)
        self.values = dict(graph.values)
        self.producer = {out: n for n in graph.nodes for out in n.outputs}
        self.readers: dict[str, int] = {}
        for n in graph.nodes:
            for name in n.input_names():
                self.readers[name] = self.readers.get(name, 0) + 1
        for out in _refs(graph.outputs):
            self.readers[out] = self.readers.get(out, 0) + 1

    def _only_for_check(self, value: str) -> Node | None:
        """The node producing `value` when the check is its one reader."""
        node = self.producer.get(value)
        return (
            node if node is not None and self.readers.get(value, 0) == 1 and len(node.outputs) == 1 else None
        )

    def _is_input(self, value: str) -> bool:
        return self.values[value].kind == "input"

    def _drop(self, node: Node) -> None:
        self.nodes.remove(node)
        for out in node.outputs:
            self.values.pop(out, None)
        for name in node.input_names():
            self.readers[name] -= 1

    def check(self, check: Node) -> None:
        cond, raise_when = check.args[0], check.args[1]
        while isinstance(cond, Ref):
            node = self._only_for_check(cond.name)
            if node is None:
                break
            step = self._step(node, raise_when)
            if step is None:
                break
            cond, raise_when = step
        if cond == check.args[0]:
            self._same_meta(check.outputs[0], cond.name)  # the comparison itself became element-wise
            return
        self.readers[cond.name] = self.readers.get(cond.name, 0) + 1
        self._drop_unread(check.args[0].name)
        index = self.nodes.index(check)
        self.nodes[index] = dataclasses.replace(check, args=(cond, raise_when, *check.args[2:]))
        self._same_meta(check.outputs[0], cond.name)

    def _same_meta(self, out: str, cond: str) -> None:
        """The check returns its condition: its output takes the condition's shape."""
        meta = dataclasses.replace(self.values[cond].meta, requires_grad=False)
        self.values[out] = dataclasses.replace(self.values[out], meta=meta)

    def _drop_unread(self, value: str) -> None:
        """Drop the nodes that computed the old condition, now read by nothing."""
        self.readers[value] -= 1
        pending = [value]
        while pending:
            name = pending.pop()
            node = self.producer.get(name)
            if node is None or node not in self.nodes or any(self.readers.get(o, 0) for o in node.outputs):
                continue
            self._drop(node)
            pending.extend(node.input_names())

    def _step(self, node: Node, raise_when: bool) -> tuple[Ref, bool] | None:
        """The element-wise condition `node`'s input gives, and how it is checked; None: keep it."""
        source = node.args[0] if node.args else None
        if not isinstance(source, Ref) or self._is_input(source.name):
            return None
        if node.op == _NOT:
            return source, not raise_when
        if _REDUCE.get(node.op) is raise_when:
            return source, raise_when
        if node.op in _COMPARE and len(node.args) == 2:
            extreme = self._only_for_check(source.name)
            if extreme is None or (extreme.op, node.op, raise_when) not in _ELEMENTWISE:
                return None
            data = extreme.args[0]
            meta = self.values[data.name].meta if isinstance(data, Ref) else None
            if meta is None or meta.dtype.startswith(_FLOATS) or self._is_input(data.name):
                return None
            return self._compare_elements(node, extreme, data), raise_when
        return None

    def _compare_elements(self, compare: Node, extreme: Node, data: Ref) -> Ref:
        """`compare` applied to the elements of `data` instead of their max/min (which goes)."""
        out = compare.outputs[0]
        meta = self.values[data.name].meta
        self.values[out] = dataclasses.replace(
            self.values[out], meta=dataclasses.replace(meta, dtype="bool", requires_grad=False)
        )
        elementwise = dataclasses.replace(compare, args=(data, compare.args[1]))
        self.nodes[self.nodes.index(compare)] = elementwise
        self.producer[out] = elementwise
        self.readers[data.name] = self.readers.get(data.name, 0) + 1
        self.readers[extreme.outputs[0]] -= 1
        self._drop(extreme)
        return Ref(out)


def _refs(obj) -> list[str]:
    if isinstance(obj, Ref):
        return [obj.name]
    if isinstance(obj, (list, tuple)):
        return [n for x in obj for n in _refs(x)]
    if isinstance(obj, dict):
        return [n for x in obj.values() for n in _refs(x)]
    return []


def localize_value_checks(graph: Graph) -> Graph:
    """The graph with each value check on a computed tensor made element-wise (module docstring)."""
    checks = [n for n in graph.nodes if n.op == VALUE_CHECK_OP]
    if not checks:
        return graph
    rewrite = _Rewrite(graph)
    for check in checks:
        rewrite.check(check)
    if rewrite.nodes == list(graph.nodes):
        return graph
    return dataclasses.replace(graph, nodes=tuple(rewrite.nodes), values=rewrite.values)
