"""Find attention written by hand: scores from q and k, scale, bias or masks, softmax, product with v.

`find_attention(graph)` lists the matches; `attention_fuse.py` rewrites each into one
`aten.scaled_dot_product_attention.default`. A match is a straight chain, every link read only by
the next (the scores and probabilities are not used elsewhere):

    scores = bmm(q, k^T) | baddbmm(bias, q, k^T, beta, alpha) | matmul(q, k^T) | einsum(q, k)
    scores = scores * c | scores / c                (c a positive Python number: the scale)
    scores = scores + bias | scores - bias          (any tensor broadcasting to the scores)
    scores = masked_fill(scores, m, -inf) | where(m, scores, -inf)   (or fill = the dtype's min)
    probs  = softmax(scores, -1)                    (in float32 for half scores if cast straight back)
    probs  = dropout(probs, p)                      (p == 0, or the trace's mode is eval)
    out    = bmm(probs, v) | matmul(probs, v) | einsum(probs, v)

einsum operands may hold their dims in any order ('bqhd,bkhd->bhqk', 'bhqk,bkhd->bqhd'): the rewrite
permutes them (and the output back); the scores' query and key dims must come last.

with views that only regroup the leading (batch, head) dims and casts to the same dtype anywhere in
between. Dropout with p > 0 in training is not matched (fusing would draw other random numbers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from nnscaler.graph.ir import Graph, ModeValue, Node, Ref

__all__ = ["AttentionMatch", "BiasStep", "find_attention"]

VIEWS = ("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default")
_SCORES = ("aten.bmm.default", "aten.baddbmm.default", "aten.matmul.default", "aten.einsum.default")
_PRODUCTS = ("aten.bmm.default", "aten.matmul.default", "aten.einsum.default")
_CASTS = ("aten.to.dtype", "aten._to_copy.default")
_SOFTMAX = ("aten.softmax.int", "aten._softmax.default")
_BIAS_OPS = (
    "aten.add.Tensor",
    "aten.sub.Tensor",
    "aten.mul.Tensor",
    "aten.div.Tensor",
    "aten.masked_fill.Scalar",
    "aten.where.ScalarOther",
    "aten.where.ScalarSelf",
)


@dataclass(frozen=True)
class BiasStep:
    """One step applied to the scores after the product q k^T, in program order.

    kind: 'add' / 'sub' (tensor `ref`), 'scale' (`value`), 'hide' (`ref` True = hidden, filled with
    `value`), 'keep' (`ref` True = kept, the rest filled with `value`). `shape` is the scores' shape
    at that step (3-D (batch*heads, s, t) or 4-D)."""

    kind: str
    ref: str | None
    value: float
    shape: tuple[int, ...]


@dataclass
class AttentionMatch:
    """A hand-written attention: what the fused call needs and which nodes it replaces."""

    score: Node
    product: Node
    nodes: list[Node]
    """Every node of the chain, score product to value product, in program order."""
    q: str
    k: str
    k_transposed: bool
    """`k` holds k^T (..., d, t): the rewrite transposes it back."""
    v: str
    scale: float
    steps: list[BiasStep] = field(default_factory=list)
    q_perm: tuple[int, ...] | None = None
    """einsum operands in another order: the permute() dims that make q (..., s, d), k (..., t, d),
    v (..., t, e), and the output (..., s, e) what the einsum returns."""
    k_perm: tuple[int, ...] | None = None
    v_perm: tuple[int, ...] | None = None
    out_perm: tuple[int, ...] | None = None


def _ref(arg: object) -> str | None:
    return arg.name if isinstance(arg, Ref) else None


def _number(arg: object) -> float | None:
    if isinstance(arg, bool) or not isinstance(arg, (int, float)):
        return None
    return float(arg)


class _Finder:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.producer = {o: n for n in graph.nodes for o in n.outputs}
        self.consumers = graph.consumers()
        self.outputs = set(graph.output_names())

    def shape(self, name: str) -> tuple[int, ...]:
        return self.graph.values[name].meta.shape

    def dtype(self, name: str) -> str:
        return self.graph.values[name].meta.dtype

    def sole_link(self, name: str | None, reader: Node) -> Node | None:
        """The producer of `name` when `reader` is its only reader and it is no graph output."""
        if name is None or name in self.outputs or self.graph.values[name].meta is None:
            return None
        if [n.name for n in self.consumers.get(name, [])] != [reader.name]:
            return None
        return self.producer.get(name)

    def keeps_rows(self, node: Node, any_dtype: bool = False) -> bool:
        """A view/cast that leaves the last two dims and (unless `any_dtype`) the dtype as they are."""
        src, out = _ref(node.args[0]), node.outputs[0]
        if src is None or self.graph.values[src].meta is None:
            return False
        if node.op in VIEWS:
            a, b = self.shape(src), self.shape(out)
            return len(a) >= 3 and len(b) >= 3 and a[-2:] == b[-2:] and math.prod(a) == math.prod(b)
        return node.op in _CASTS and (any_dtype or self.dtype(src) == self.dtype(out))

    def after_softmax(
        self, name: str, reader: Node, chain: list[Node], cast_back: str | None = None
    ) -> AttentionMatch | None:
        """Walk back from the probabilities to the softmax; `cast_back`: the dtype a cast after it
        returned to (a softmax computed in float32 for half scores)."""
        node = self.sole_link(name, reader)
        if node is None:
            return None
        chain.append(node)
        if node.op in _SOFTMAX:
            src = _ref(node.args[0])
            rank = len(self.shape(node.outputs[0]))
            if src is None or node.args[1] not in (-1, rank - 1):
                return None
            if self.dtype(name) != self.dtype(src) and cast_back != self.dtype(src):
                return None  # probabilities in another dtype than the scores
            return self.before_softmax(src, node, chain, [])
        if node.op == "aten.dropout.default":
            p, train = node.args[1], node.args[2]
            p = p.train if isinstance(p, ModeValue) else p
            train = train.train if isinstance(train, ModeValue) else train
            if p and train:
                return None
        elif node.op in _CASTS and cast_back is None and self.keeps_rows(node, any_dtype=True):
            cast_back = self.dtype(name)
        elif not self.keeps_rows(node):
            return None
        return self.after_softmax(_ref(node.args[0]), node, chain, cast_back)

    def before_softmax(
        self, name: str | None, reader: Node, chain: list[Node], steps: list[BiasStep]
    ) -> AttentionMatch | None:
        node = self.sole_link(name, reader)
        if node is None:
            return None
        shape = self.shape(node.outputs[0])
        if node.op in _SCORES:
            return self.scores(node, chain + [node], steps)
        if self.keeps_rows(node):
            return self.before_softmax(_ref(node.args[0]), node, chain + [node], steps)
        if node.op not in _BIAS_OPS:
            return None
        for pos, step in self.bias_step(node, shape):
            found = self.before_softmax(_ref(node.args[pos]), node, chain + [node], [step, *steps])
            if found is not None:
                return found
        return None

    def bias_step(self, node: Node, shape: tuple[int, ...]) -> list[tuple[int, BiasStep]]:
        """(position of the scores among the args, the step) for each reading of `node`."""
        a, b = node.args[0], node.args[1] if len(node.args) > 1 else None
        op = node.op
        if op in ("aten.mul.Tensor", "aten.div.Tensor"):
            c = _number(b)
            if c is None or c <= 0 or not math.isfinite(c):
                return []
            return [(0, BiasStep("scale", None, c if op.startswith("aten.mul") else 1.0 / c, shape))]
        if op in ("aten.add.Tensor", "aten.sub.Tensor"):
            alpha = node.kwargs.get("alpha", 1)
            if _ref(a) is None or _ref(b) is None or alpha != 1:
                return []
            if op == "aten.sub.Tensor":
                return [(0, BiasStep("sub", _ref(b), 1.0, shape))]
            return [(0, BiasStep("add", _ref(b), 1.0, shape)), (1, BiasStep("add", _ref(a), 1.0, shape))]
        if op == "aten.masked_fill.Scalar":
            fill = _number(node.args[2])
            return [(0, BiasStep("hide", _ref(b), fill, shape))] if self.is_fill(fill, node) else []
        if op == "aten.where.ScalarOther":  # where(m, scores, fill)
            fill = _number(node.args[2])
            return [(1, BiasStep("keep", _ref(a), fill, shape))] if self.is_fill(fill, node) else []
        fill = _number(b)  # where(m, fill, scores)
        return [(2, BiasStep("hide", _ref(a), fill, shape))] if self.is_fill(fill, node) else []

    def is_fill(self, fill: float | None, node: Node) -> bool:
        """-inf, or the lowest finite value of the scores' dtype (what HF models fill with)."""
        if fill is None:
            return False
        dtype = getattr(torch, self.dtype(node.outputs[0]), None)
        lowest = (
            torch.finfo(dtype).min if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None
        )
        return fill == float("-inf") or fill == lowest

    def scores(self, node: Node, chain: list[Node], steps: list[BiasStep]) -> AttentionMatch | None:
        out = self.shape(node.outputs[0])
        scale, q_perm, k_perm = 1.0, None, None
        if node.op == "aten.einsum.default":
            operands = _einsum_scores(node)
            if operands is None:
                return None
            q, k, transposed, q_perm, k_perm = operands
        elif node.op == "aten.baddbmm.default":
            bias, q, k = (_ref(x) for x in node.args[:3])
            beta, alpha = (_number(node.kwargs.get(n, 1)) for n in ("beta", "alpha"))
            if len(node.args) > 3 or bias is None or beta is None or alpha is None or alpha <= 0:
                return None
            scale = alpha
            if beta != 0:
                steps = [BiasStep("add", bias, beta, out), *steps]
            transposed = True
        else:
            q, k = (_ref(x) for x in node.args[:2])
            transposed = True
        if q is None or k is None or len(self.shape(q)) != len(out) or len(self.shape(k)) != len(out):
            return None
        return AttentionMatch(node, chain[0], chain[::-1], q, k, transposed, "", scale, steps, q_perm, k_perm)


def _equation(node: Node) -> tuple[str, str, str, list] | None:
    """(first operand's letters, second's, output's, operands) of a two-operand einsum, no `...`."""
    eq, operands = node.args[0], node.args[1]
    if not isinstance(eq, str) or len(operands) != 2 or "." in eq:
        return None
    ins, _, out = eq.replace(" ", "").partition("->")
    a, _, b = ins.partition(",")
    if len(out) not in (3, 4) or not len(a) == len(b) == len(out) or len(set(out)) != len(out):
        return None
    return a, b, out, operands


def _perm(have: str, want: str) -> tuple[int, ...] | None:
    """The permute() dims that bring letters `have` into the order `want` (None: already so)."""
    if sorted(have) != sorted(want) or len(set(have)) != len(have):
        raise ValueError
    dims = tuple(have.index(x) for x in want)
    return None if dims == tuple(range(len(dims))) else dims


def _einsum_scores(node: Node) -> tuple[str, str, bool, tuple | None, tuple | None] | None:
    """(q, k, k given as k^T, q's permute, k's permute) of einsum scores '..s..d, ..t..d -> ..st'
    (the operands' letters in any order; the output's query and key letters last)."""
    eq = _equation(node)
    if eq is None:
        return None
    a, b, out, operands = eq
    lead, s, t = out[:-2], out[-2], out[-1]
    contracted = set(a) - set(out)
    if len(contracted) != 1 or set(b) - set(out) != contracted:
        return None
    c = contracted.pop()
    try:
        q_perm = _perm(a, lead + s + c)
        if b == lead + c + t:
            return _ref(operands[0]), _ref(operands[1]), True, q_perm, None
        return _ref(operands[0]), _ref(operands[1]), False, q_perm, _perm(b, lead + t + c)
    except ValueError:
        return None


def _einsum_values(node: Node) -> tuple[str | None, tuple | None, tuple | None] | None:
    """(v, v's permute, the output's permute from (..., s, e)) of einsum '..st, ..t..e -> ..s..e' when the
    probabilities (in their own order, key letter last) are the first operand."""
    eq = _equation(node)
    if eq is None:
        return None
    a, b, out, operands = eq
    lead, s, t = a[:-2], a[-2], a[-1]
    extra = set(b) - set(a)
    if len(extra) != 1 or t in out or set(out) != set(lead + s) | extra:
        return None
    e = extra.pop()
    try:
        return _ref(operands[1]), _perm(b, lead + t + e), _perm(lead + s + e, out)
    except ValueError:
        return None


def find_attention(graph: Graph) -> list[AttentionMatch]:
    """Every hand-written attention of `graph`, in program order (see the module's docstring)."""
    finder = _Finder(graph)
    found = []
    for node in graph.nodes:
        if node.op not in _PRODUCTS or node.outputs[0] not in graph.values:
            continue
        v_perm = out_perm = None
        if node.op == "aten.einsum.default":
            values = _einsum_values(node)
            v, v_perm, out_perm = values if values is not None else (None, None, None)
            probs = _ref(node.args[1][0]) if v is not None else None
        else:
            probs, v = _ref(node.args[0]), _ref(node.args[1])
        if probs is None or v is None or graph.values[v].meta is None:
            continue
        if len(finder.shape(v)) != len(finder.shape(node.outputs[0])):
            continue
        match = finder.after_softmax(probs, node, [node])
        if match is not None:
            match.v, match.v_perm, match.out_perm = v, v_perm, out_perm
            match.product = node
            found.append(match)
    return found
