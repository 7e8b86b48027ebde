"""Rewrite hand-written attention (attention_pattern.py) into `aten.scaled_dot_product_attention`.

    fuse_attention(graph) -> graph

Each match becomes one SDPA node (the user's source line and module path of the scores product), so
the attention rule applies: heads split under tensor parallelism, the sequence under context
parallelism (graph/ops/attention.py). Operands of shape (batch*heads, s, d) are read from the
(batch, heads, s, d) tensor they were reshaped from when there is one (or reshaped to it), so the
heads stay a dim of their own. The scale becomes `scale=`; the additive biases and masks become
`attn_mask`, built by the same ops applied to the bias instead of the scores (a boolean mask alone
stays boolean, True = attend; the causal mask alone becomes `is_causal=True`, attention_causal.py):
SDPA computes softmax(q k^T * scale + attn_mask) v, the same numbers up to round-off (the order of
the scale and the additions may differ).
"""

from __future__ import annotations

import dataclasses

from nnscaler.graph.capture.attention_causal import causal_mask_kind
from nnscaler.graph.capture.attention_pattern import VIEWS, AttentionMatch, find_attention
from nnscaler.graph.ir import Graph, Node, Ref, SymExpr, TensorMeta, Value, map_refs

__all__ = ["fuse_attention"]

SDPA = "aten.scaled_dot_product_attention.default"
CAUSAL = "is_causal"
"""`_mask`'s answer for a mask that is exactly the causal one: SDPA's `is_causal=True`, no mask."""
_PURE = (
    *VIEWS,
    "aten.transpose.int",
    "aten.permute.default",
    "aten.select.int",
    "aten.slice.Tensor",
    "aten.expand.default",
    "aten.unsqueeze.default",
    "aten.clone.default",
    "aten.contiguous.default",
    "aten.empty.memory_format",
    "aten.zeros.default",
    "aten.ones.default",
    "aten.arange.default",
    "aten.arange.start",
    "aten.tril.default",
    "aten.triu.default",
    "aten.bitwise_not.default",
    "aten.logical_not.default",
    "aten.le.Tensor",
    "aten.ge.Tensor",
    "aten.lt.Tensor",
    "aten.gt.Tensor",
)
"""Ops the rewrite may leave unread and then drops (no side effects): views, and what makes masks."""


def _size(meta: TensorMeta, dim: int) -> int | SymExpr:
    code = meta.sym[dim] if meta.sym else None
    return SymExpr(code, meta.shape[dim]) if code else meta.shape[dim]


def _sym(sizes: list[int | SymExpr]) -> tuple[str | None, ...] | None:
    sym = tuple(s.code if isinstance(s, SymExpr) else None for s in sizes)
    return sym if any(sym) else None


def _hint(size: int | SymExpr) -> int:
    return size.hint if isinstance(size, SymExpr) else size


class _Emitter:
    """New nodes for one match, named apart from the graph's values."""

    def __init__(self, graph: Graph, like: Node, taken: set[str], base: str):
        self.graph, self.like, self.taken, self.base = graph, like, taken, base
        self.nodes: list[Node] = []
        self.values: dict[str, Value] = {}

    def meta(self, name: str) -> TensorMeta:
        return (self.values.get(name) or self.graph.values[name]).meta

    def emit(
        self,
        op: str,
        args: tuple,
        kwargs: dict,
        sizes: list,
        dtype: str,
        name: str | None = None,
        role: str = "mask",
    ) -> str:
        """Append `op(*args, **kwargs)`; its output is `name`, or `<attention>_<role>` (numbered)."""
        if name is None:
            name, k = f"{self.base}_{role}", 0
            while name in self.taken:
                k += 1
                name = f"{self.base}_{role}_{k}"
        self.taken.add(name)
        grad = any(self.meta(r.name).requires_grad for r in args if isinstance(r, Ref))
        meta = TensorMeta(tuple(_hint(s) for s in sizes), dtype, grad, _sym(sizes))
        self.values[name] = Value(name, meta, producer=name)
        node = Node(
            name, op, args, kwargs, (name,), self.like.source, self.like.module_path, self.like.module_class
        )
        self.nodes.append(dataclasses.replace(node, no_grad=self.like.no_grad))
        return name

    def sizes(self, name: str) -> list[int | SymExpr]:
        meta = self.meta(name)
        return [_size(meta, d) for d in range(len(meta.shape))]

    def reshape(self, name: str, sizes: list, role: str) -> str:
        dtype = self.meta(name).dtype
        return self.emit("aten.reshape.default", (Ref(name), list(sizes)), {}, sizes, dtype, role=role)

    def transpose(self, name: str) -> str:
        sizes = self.sizes(name)
        rank = len(sizes)
        sizes[-2], sizes[-1] = sizes[-1], sizes[-2]
        return self.emit(
            "aten.transpose.int",
            (Ref(name), rank - 2, rank - 1),
            {},
            sizes,
            self.meta(name).dtype,
            role="key",
        )

    def permute(self, name: str, dims: tuple[int, ...], role: str, out: str | None = None) -> str:
        sizes = [self.sizes(name)[d] for d in dims]
        dtype = self.meta(name).dtype
        return self.emit(
            "aten.permute.default", (Ref(name), list(dims)), {}, sizes, dtype, name=out, role=role
        )

    def broadcast(self, op: str, args: tuple, a: str, b: str, dtype: str) -> str:
        sa, sb = self.sizes(a), self.sizes(b)
        n = max(len(sa), len(sb))
        sa, sb = [1] * (n - len(sa)) + sa, [1] * (n - len(sb)) + sb
        sizes = [y if _hint(x) == 1 else x for x, y in zip(sa, sb)]
        return self.emit(op, args, {}, sizes, dtype)


def _source_4d(graph: Graph, producer: dict[str, Node], name: str) -> str | None:
    """The 4-D tensor a 3-D (batch*heads, x, y) operand was reshaped from, if any."""
    node = producer.get(name)
    if node is None or node.op not in VIEWS or not isinstance(node.args[0], Ref):
        return None
    src = graph.values[node.args[0].name].meta
    out = graph.values[name].meta.shape
    if src is None or len(src.shape) != 4 or len(out) != 3 or src.shape[0] * src.shape[1] != out[0]:
        return None
    return node.args[0].name if src.shape[2:] == out[1:] else None


def _transposed_from(producer: dict[str, Node], graph: Graph, name: str) -> str | None:
    """x when `name` is x.transpose(-2, -1) (or a permute that swaps only the last two dims)."""
    node = producer.get(name)
    if node is None or not isinstance(node.args[0], Ref):
        return None
    rank = len(graph.values[name].meta.shape)
    if node.op == "aten.transpose.int":
        return node.args[0].name if {d % rank for d in node.args[1:3]} == {rank - 2, rank - 1} else None
    if node.op == "aten.permute.default":
        dims = [d % rank for d in node.args[1]]
        return node.args[0].name if dims == [*range(rank - 2), rank - 1, rank - 2] else None
    return None


def _operands(em: _Emitter, graph: Graph, producer: dict[str, Node], m: AttentionMatch):
    """(q, k, v) as (..., s, d), (..., t, d), (..., t, e) with one leading shape, and (batch, heads)
    sizes when 3-D operands were lifted to 4-D (None: kept as they are)."""
    q, k, v = (
        em.permute(x, dims, role) if dims else x
        for x, dims, role in ((m.q, m.q_perm, "query"), (m.k, m.k_perm, "key"), (m.v, m.v_perm, "value"))
    )
    lead = None
    if len(em.meta(q).shape) == 3:
        sources = [_source_4d(graph, producer, x) for x in (q, k, v)]
        known = next((s for s in sources if s is not None), None)
        if known is not None:
            lead = em.sizes(known)[:2]
            q, k, v = (
                s
                if s is not None and graph.values[s].meta.shape[:2] == tuple(map(_hint, lead))
                else em.reshape(x, lead + em.sizes(x)[1:], role)
                for s, x, role in zip(sources, (q, k, v), ("query", "key", "value"))
            )
    if m.k_transposed:
        k = _transposed_from(producer, graph, k) or em.transpose(k)
    qs, ks, vs = (em.meta(x).shape for x in (q, k, v))
    if not (qs[:-2] == ks[:-2] == vs[:-2] and qs[-1] == ks[-1] and ks[-2] == vs[-2]):
        return None
    return q, k, v, lead


def _to_rank(em: _Emitter, name: str, step_shape: tuple[int, ...], lead) -> str:
    """A bias/mask read against 3-D scores, reshaped to broadcast against the 4-D ones."""
    shape = em.meta(name).shape
    if lead is None or len(step_shape) != 3 or len(shape) != 3 or shape[0] == 1:
        return name
    return em.reshape(name, lead + em.sizes(name)[1:], "bias")


def _mask(
    em: _Emitter, m: AttentionMatch, lead, dtype: str, qk: tuple[str, str]
) -> tuple[str | None, float] | None:
    """(attn_mask, scale): the steps applied to a bias instead of the scores."""
    acc, scale, keep, hide = None, m.scale, [], []
    for step in m.steps:
        if step.kind == "scale":
            scale *= step.value
            if acc is not None:
                acc = em.emit("aten.mul.Tensor", (Ref(acc), step.value), {}, em.sizes(acc), dtype)
            continue
        if len(step.shape) == 4 and len(em.meta(m.q).shape) == 3:
            if lead is None or step.shape[:2] != tuple(map(_hint, lead)):
                return None  # 3-D operands whose scores were viewed as 4-D otherwise than they were
        ref = _to_rank(em, step.ref, step.shape, lead)
        if step.kind in ("add", "sub"):
            if step.value != 1.0:
                ref = em.emit("aten.mul.Tensor", (Ref(ref), step.value), {}, em.sizes(ref), dtype)
            if acc is None:
                neg = step.kind == "sub"
                acc = em.emit("aten.neg.default", (Ref(ref),), {}, em.sizes(ref), dtype) if neg else ref
            else:
                op = f"aten.{step.kind}.Tensor"
                acc = em.broadcast(op, (Ref(acc), Ref(ref)), acc, ref, dtype)
        elif step.value == float("-inf"):
            (keep if step.kind == "keep" else hide).append(ref)
        elif acc is None:
            return None  # a finite fill before any bias: no float mask to fill
        elif step.kind == "hide":
            acc = em.broadcast("aten.masked_fill.Scalar", (Ref(acc), Ref(ref), step.value), acc, ref, dtype)
        else:
            acc = em.broadcast("aten.where.ScalarOther", (Ref(ref), Ref(acc), step.value), ref, acc, dtype)
    if acc is None and not keep and not hide:
        return None, scale
    if (
        acc is None
        and len(keep + hide) == 1
        and _causal(em, qk, (keep + hide)[0], "keep" if keep else "hide")
    ):
        return CAUSAL, scale
    if acc is None:  # only -inf masks: one boolean mask, True = attend
        allowed = [em.emit("aten.logical_not.default", (Ref(h),), {}, em.sizes(h), "bool") for h in hide]
        allowed = keep + allowed
        acc = allowed[0]
        for other in allowed[1:]:
            acc = em.broadcast("aten.logical_and.default", (Ref(acc), Ref(other)), acc, other, "bool")
        return acc, scale
    for h in hide:
        acc = em.broadcast("aten.masked_fill.Scalar", (Ref(acc), Ref(h), float("-inf")), acc, h, dtype)
    for kept in keep:
        acc = em.broadcast("aten.where.ScalarOther", (Ref(kept), Ref(acc), float("-inf")), kept, acc, dtype)
    return acc, scale


def _causal(em: _Emitter, qk: tuple[str, str], mask: str, kind: str) -> bool:
    """Whether `mask` (True = `kind`) is the causal mask of this attention's sequence (no other mask)."""
    q, k = (em.meta(x) for x in qk)
    size, other = _size(q, -2), _size(k, -2)
    same = (
        size.code == other.code if isinstance(size, SymExpr) and isinstance(other, SymExpr) else size == other
    )
    return same and mask in em.graph.values and causal_mask_kind(em.graph, mask, size) == kind


def _rewrite(graph: Graph, m: AttentionMatch, taken: set[str], base: str):
    """(new nodes, their values, nodes replaced, {old value: new name}) for one match, or None where it
    cannot be fused. The attention's output is named `base` (its readers are renamed to it)."""
    producer = {o: n for n in graph.nodes for o in n.outputs}
    consumers = graph.consumers()
    em = _Emitter(graph, m.score, taken, base)
    operands = _operands(em, graph, producer, m)
    if operands is None:
        return None
    q, k, v, lead = operands
    dtype = em.meta(q).dtype
    if {graph.values[x.outputs[0]].meta.dtype for x in (m.score, m.product)} != {dtype}:
        return None
    mask = _mask(em, m, lead, dtype, (q, k))
    if mask is None:
        return None
    attn_mask, scale = mask
    out = m.product.outputs[0]
    outputs = set(graph.output_names())
    replaced = list(m.nodes)
    target = out
    if lead is not None:  # 4-D result: read directly where the user views it so, else viewed back
        readers = consumers.get(out, [])
        want = tuple(em.meta(q).shape[:-1]) + (em.meta(v).shape[-1],)
        if len(readers) == 1 and readers[0].op in VIEWS and out not in outputs:
            if graph.values[readers[0].outputs[0]].meta.shape == want:
                target = readers[0].outputs[0]
                replaced.append(readers[0])
    kwargs = {"is_causal": True, "scale": scale} if attn_mask == CAUSAL else {"scale": scale}
    attn_mask = None if attn_mask == CAUSAL else attn_mask
    args = (Ref(q), Ref(k), Ref(v)) + ((Ref(attn_mask),) if attn_mask else ())
    sizes = em.sizes(q)[:-1] + em.sizes(v)[-1:]
    for n in replaced:
        taken.discard(n.outputs[0])
    name = target if target in outputs and not m.out_perm else base
    result = em.emit(SDPA, args, kwargs, sizes, dtype, name=name)
    renamed = {target: result} if result != target else {}
    if lead is not None and target == out:
        em.emit("aten.reshape.default", (Ref(result), em.sizes(out)), {}, em.sizes(out), dtype, name=out)
        renamed = {}
    elif m.out_perm:  # einsum output in another order than (..., s, e)
        em.permute(result, m.out_perm, "output", out=out)
        renamed = {}
    return em.nodes, em.values, replaced, renamed


def _drop_unread(
    nodes: list[Node], values: dict[str, Value], outputs: set[str], seeds: set[str]
) -> list[Node]:
    """Drop pure view-like nodes left unread by the rewrite (starting from the values it stopped reading)."""
    while True:
        read = {r for n in nodes for r in n.input_names()} | outputs
        dead = [n for n in nodes if n.op in _PURE and n.outputs[0] in seeds and not set(n.outputs) & read]
        if not dead:
            return nodes
        gone = {id(n) for n in dead}
        for n in dead:
            seeds |= set(n.input_names())
            for o in n.outputs:
                values.pop(o, None)
        nodes = [n for n in nodes if id(n) not in gone]


def _fresh(taken: set[str], stem: str) -> str:
    name, k = stem, 0
    while name in taken:
        k += 1
        name = f"{stem}_{k}"
    return name


def fuse_attention(graph: Graph) -> Graph:
    """`graph` with each hand-written attention replaced by one scaled_dot_product_attention node."""
    matches = find_attention(graph)
    if not matches:
        return graph
    nodes, values = list(graph.nodes), dict(graph.values)
    taken = set(values) | {n.name for n in nodes}
    seeds: set[str] = set()
    for m in matches:
        view = dataclasses.replace(graph, nodes=tuple(nodes), values=values)
        rewrite = _rewrite(view, m, taken, _fresh(taken, "attention"))
        if rewrite is None:
            continue
        new_nodes, new_values, replaced, renamed = rewrite
        gone = {id(n) for n in replaced}
        at = next(i for i, n in enumerate(nodes) if n is m.product)
        before = [n for n in nodes[:at] if id(n) not in gone]
        after = [_renamed(n, renamed) for n in nodes[at:] if id(n) not in gone]
        for n in replaced:
            seeds |= set(n.input_names())
            for o in n.outputs:
                values.pop(o, None)
        values.update(new_values)
        nodes = before + new_nodes + after
    nodes = _drop_unread(nodes, values, set(graph.output_names()), seeds)
    return dataclasses.replace(graph, nodes=tuple(nodes), values=values)


def _renamed(node: Node, renamed: dict[str, str]) -> Node:
    if not renamed or not set(node.input_names()) & renamed.keys():
        return node
    fn = lambda r: Ref(renamed.get(r.name, r.name))  # noqa: E731
    return dataclasses.replace(node, args=map_refs(node.args, fn), kwargs=map_refs(dict(node.kwargs), fn))
