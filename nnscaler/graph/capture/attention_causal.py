"""Whether a boolean attention mask is the causal one (key <= query) for every sequence length.

Recognised, through `unsqueeze`, full-range `slice`, `clone` and `~`:
    torch.ones(s, s, dtype=torch.bool).tril()          True = attend
    torch.triu(torch.ones(s, s, dtype=torch.bool), 1)   True = hidden
    pos[None, :] <= pos[:, None]  (any of <=, >=, <, > that means key <= query or key > query), pos an
    arange(s) from 0
with `s` the attention's own sequence size (the same expression where sizes are symbolic). Hand-written
attention masked so becomes SDPA with `is_causal=True`: no (s, s) mask is made, and context parallelism
balances the causal work (zigzag).
"""

from __future__ import annotations

from nnscaler.graph.ir import Graph, Node, Ref, SymExpr

__all__ = ["causal_mask_kind"]

_NOT = ("aten.bitwise_not.default", "aten.logical_not.default")
_FLIP = {"le": "ge", "ge": "le", "lt": "gt", "gt": "lt"}
_FULL = 2**62
_WRAPS = ("aten.unsqueeze.default", "aten.view.default", "aten.reshape.default", "aten.expand.default")


def _same_size(a: object, b: int | SymExpr) -> bool:
    if isinstance(a, SymExpr) or isinstance(b, SymExpr):
        return isinstance(a, SymExpr) and isinstance(b, SymExpr) and a.code == b.code
    return isinstance(a, int) and a == b


class _Reader:
    def __init__(self, graph: Graph, size: int | SymExpr):
        self.graph, self.size = graph, size
        self.producer = {o: n for n in graph.nodes for o in n.outputs}

    def node(self, arg: object) -> Node | None:
        return self.producer.get(arg.name) if isinstance(arg, Ref) else None

    def shape(self, node: Node) -> tuple[int, ...]:
        return self.graph.values[node.outputs[0]].meta.shape

    def unwrap(self, arg: object) -> tuple[Node | None, int]:
        """(the node under leading-dim wrappers, slices of everything and clones, how many `~`)."""
        node, nots = self.node(arg), 0
        while node is not None:
            src = self.node(node.args[0])
            leading = src is not None and self.shape(node)[-len(self.shape(src)) :] == self.shape(src)
            if node.op in _NOT:
                nots += 1
            elif not (
                (
                    node.op in _WRAPS
                    and leading
                    and all(d == 1 for d in self.shape(node)[: -len(self.shape(src))])
                )
                or (node.op == "aten.slice.Tensor" and _full_slice(node))
                or node.op in ("aten.clone.default", "aten.alias.default")
            ):
                return node, nots
            node = src
        return None, nots

    def position_axis(self, arg: object) -> int | None:
        """-1 or -2: the axis along which `arg` (an arange(size) from 0, every other dim 1) varies."""
        chain, node = [], self.node(arg)
        while node is not None and node.op in ("aten.unsqueeze.default", "aten.slice.Tensor"):
            if node.op == "aten.slice.Tensor" and not _full_slice(node):
                return None
            chain.append(node)
            node = self.node(node.args[0])
        if node is None:
            return None
        if node.op == "aten.arange.default":
            ok = len(node.args) == 1 and _same_size(node.args[0], self.size)
        elif node.op == "aten.arange.start":
            ok = len(node.args) == 2 and node.args[0] == 0 and _same_size(node.args[1], self.size)
        else:
            ok = False
        if not ok:
            return None
        rank, axis = 1, 0
        for n in reversed(chain):
            if n.op == "aten.unsqueeze.default":
                d = n.args[1] % (rank + 1)
                axis, rank = (axis + 1 if d <= axis else axis), rank + 1
        shape = self.graph.values[arg.name].meta.shape
        if len(shape) != rank or any(n != 1 for i, n in enumerate(shape) if i != axis):
            return None
        return axis - rank

    def kind(self, arg: object) -> str | None:
        node, nots = self.unwrap(arg)
        if node is None:
            return None
        kind = self._base(node)
        if kind is None:
            return None
        return kind if nots % 2 == 0 else {"keep": "hide", "hide": "keep"}[kind]

    def _base(self, node: Node) -> str | None:
        op = node.op.split(".")[1]
        if op in ("tril", "triu"):
            diagonal = node.args[1] if len(node.args) > 1 else node.kwargs.get("diagonal", 0)
            ones, nots = self.unwrap(node.args[0])
            if ones is None or nots or ones.op != "aten.ones.default" or len(ones.args[0]) != 2:
                return None
            if not all(_same_size(s, self.size) for s in ones.args[0]):
                return None
            return {("tril", 0): "keep", ("triu", 1): "hide"}.get((op, diagonal))
        if op in _FLIP and node.op.endswith(".Tensor"):
            a, b = self.position_axis(node.args[0]), self.position_axis(node.args[1])
            if {a, b} != {-1, -2}:
                return None
            rel = op if a == -1 else _FLIP[op]  # key `rel` query
            return {"le": "keep", "gt": "hide"}.get(rel)
        return None


def _full_slice(node: Node) -> bool:
    start = node.args[2] if len(node.args) > 2 else 0
    end = node.args[3] if len(node.args) > 3 else _FULL
    step = node.args[4] if len(node.args) > 4 else 1
    return start in (0, None) and step == 1 and isinstance(end, int) and end >= _FULL


def causal_mask_kind(graph: Graph, mask: str, size: int | SymExpr) -> str | None:
    """'keep' where `mask` is True exactly where key <= query, 'hide' where exactly where key > query,
    for queries and keys of length `size` (None: not provably causal)."""
    meta = graph.values[mask].meta
    if meta is None or meta.dtype != "bool" or len(meta.shape) < 2 or any(d != 1 for d in meta.shape[:-2]):
        return None
    return _Reader(graph, size).kind(Ref(mask))
