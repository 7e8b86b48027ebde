"""Vector and tensor products (mv, dot, outer, inner, tensordot, vecdot, multi_dot): each written as
the einsum it computes, whose annotation einsum.py reads off the equation (summed letters `+`)."""

from __future__ import annotations

from string import ascii_letters

from nnscaler.graph.ops.einsum import einsum_annotation
from nnscaler.graph.ops.registry import OpCall, rule


def _shapes(call: OpCall) -> list[tuple[int, ...]]:
    return [tuple(m.shape) for m in call.inputs]


@rule("aten.mv.default", "linear")
def mv(call: OpCall) -> str:
    return einsum_annotation("mk,k->m", _shapes(call))


@rule(["aten.dot.default", "aten.vdot.default"], "linear")
def dot(call: OpCall) -> str:
    return einsum_annotation("k,k->", _shapes(call))


@rule(["aten.outer.default", "aten.ger.default"], "linear")
def outer(call: OpCall) -> str:
    return einsum_annotation("m,n->mn", _shapes(call))


@rule("aten.inner.default", "linear")
def inner(call: OpCall) -> str:
    """Sums the last dims of both (a 0-d operand: a product, nothing summed)."""
    a, b = _shapes(call)
    if not a or not b:
        sa, sb = ascii_letters[: len(a)], ascii_letters[len(a) : len(a) + len(b)]
        return einsum_annotation(f"{sa},{sb}->{sa}{sb}", [a, b])
    sa = ascii_letters[: len(a) - 1]
    sb = ascii_letters[len(a) - 1 : len(a) + len(b) - 2]
    k = ascii_letters[len(a) + len(b) - 2]
    return einsum_annotation(f"{sa}{k},{sb}{k}->{sa}{sb}", [a, b])


@rule("aten.tensordot.default", "linear")
def tensordot(call: OpCall) -> str:
    a, b = _shapes(call)
    dims_a = [d % len(a) for d in call.arg(2, "dims_self")]
    dims_b = [d % len(b) for d in call.arg(3, "dims_other")]
    la = list(ascii_letters[: len(a)])
    lb = list(ascii_letters[len(a) : len(a) + len(b)])
    for i, j in zip(dims_a, dims_b):
        lb[j] = la[i]
    out = [c for i, c in enumerate(la) if i not in dims_a] + [c for j, c in enumerate(lb) if j not in dims_b]
    return einsum_annotation(f"{''.join(la)},{''.join(lb)}->{''.join(out)}", [a, b])


@rule("aten.linalg_vecdot.default", "linear")
def vecdot(call: OpCall) -> str:
    """x and y broadcast together, then summed along `dim` of the broadcast shape."""
    a, b = _shapes(call)
    rank = max(len(a), len(b))
    dim = call.arg(2, "dim", -1) % rank
    ids = ascii_letters[:rank]
    out = ids[:dim] + ids[dim + 1 :]
    return einsum_annotation(f"{ids[rank - len(a) :]},{ids[rank - len(b) :]}->{out}", [a, b])


@rule(["aten.linalg_multi_dot.default", "aten.chain_matmul.default"], "linear")
def multi_dot(call: OpCall) -> str:
    """A chain of matrix products; multi_dot's first and last operands may be vectors."""
    shapes = _shapes(call)
    chain = ascii_letters[: len(shapes) + 1]
    subs = [chain[i : i + 2] for i in range(len(shapes))]
    if len(shapes[0]) == 1:
        subs[0] = chain[1]
    if len(shapes[-1]) == 1:
        subs[-1] = chain[-2]
    out = ("" if len(shapes[0]) == 1 else chain[0]) + ("" if len(shapes[-1]) == 1 else chain[-1])
    return einsum_annotation(",".join(subs) + "->" + out, shapes)
