"""einsum: the annotation read off the equation, for any equation.

A letter kept in the output is a plain dim (splitting it splits the output the same way); a letter
summed away is a reduction (`k+`: split, each device holds a partial sum, which einsum's linearity in
every operand makes exact). A letter repeated within one operand takes a diagonal (`ii->i`): `^`,
never split. `...` stands for the same dims, aligned right, in every operand that has it; summed away
when the output leaves it out. A dim of size 1 against a larger size of its letter elsewhere
broadcasts: annotated `1`, that operand is read whole. Without `->` the output is `...` then the
letters used once, in sorted order (torch's implicit mode).
"""

from __future__ import annotations

from collections import Counter

from nnscaler.graph.ops.annotation import AnnotationError
from nnscaler.graph.ops.registry import OpCall, rule

__all__ = ["einsum_annotation", "einsum_flops", "parse_equation"]

_ELLIPSIS = "."


def _terms(text: str) -> list[str]:
    """A subscript as its labels, '...' as one label '.'."""
    if text.count("...") > 1 or text.replace("...", "").count("."):
        raise AnnotationError(f"einsum subscript {text!r} has a malformed '...'")
    out = []
    for part in text.split("..."):
        out.extend(part)
        out.append(_ELLIPSIS)
    out.pop()
    if not all(c == _ELLIPSIS or c.isalpha() for c in out):
        raise AnnotationError(f"einsum subscript {text!r}: only letters and '...' are allowed")
    return out


def parse_equation(equation: str, n_operands: int) -> tuple[list[list[str]], list[str]]:
    """(labels of each operand, labels of the output); the implicit output made explicit."""
    eq = "".join(equation.split())
    lhs, arrow, rhs = eq.partition("->")
    operands = [_terms(t) for t in lhs.split(",")]
    if len(operands) != n_operands:
        raise AnnotationError(
            f"einsum equation {equation!r} names {len(operands)} operands, got {n_operands}"
        )
    if arrow:
        return operands, _terms(rhs)
    counts = Counter(c for op in operands for c in op if c != _ELLIPSIS)
    ell = [_ELLIPSIS] if any(_ELLIPSIS in op for op in operands) else []
    return operands, ell + sorted(c for c, n in counts.items() if n == 1)


def _expand(labels: list[str], rank: int, n_ell: int) -> list[str]:
    """Labels of each dim of an operand of `rank` dims; ellipsis dims as '_e<j>', aligned right over n_ell."""
    if _ELLIPSIS not in labels:
        if len(labels) != rank:
            raise AnnotationError(
                f"einsum subscript {''.join(labels)!r} has {len(labels)} labels for {rank} dims"
            )
        return list(labels)
    k = labels.index(_ELLIPSIS)
    count = rank - (len(labels) - 1)
    if count < 0:
        raise AnnotationError(f"einsum subscript {''.join(labels)!r} has too many labels for {rank} dims")
    return labels[:k] + [f"_e{j}" for j in range(n_ell - count, n_ell)] + labels[k + 1 :]


def einsum_annotation(equation: str, shapes: list[tuple[int, ...]]) -> str:
    """The dim annotation of `torch.einsum(equation, *operands)` for operands of these shapes."""
    operands, output = parse_equation(equation, len(shapes))
    n_ell = max(
        (len(shape) - (len(labels) - 1) for labels, shape in zip(operands, shapes) if _ELLIPSIS in labels),
        default=0,
    )
    dims = [_expand(labels, len(shape), n_ell) for labels, shape in zip(operands, shapes)]
    size: dict[str, int] = {}
    for ids, shape in zip(dims, shapes):
        for ident, n in zip(ids, shape):
            size[ident] = max(size.get(ident, 1), n)
    out_ids = [i for c in output for i in ([f"_e{j}" for j in range(n_ell)] if c == _ELLIPSIS else [c])]
    diagonal = {i for ids in dims for i, n in Counter(ids).items() if n > 1}
    kept = set(out_ids)

    def name(ident: str) -> str:
        return ident + ("^" if ident in diagonal else "" if ident in kept else "+")

    ins = [
        " ".join("1" if n == 1 and size[i] != 1 else name(i) for i, n in zip(ids, shape))
        for ids, shape in zip(dims, shapes)
    ]
    return ", ".join(ins) + " -> " + " ".join(name(i) for i in out_ids)


def einsum_flops(equation: str, shapes: list[tuple[int, ...]]) -> float:
    """Forward FLOPs of the einsum as one contraction: 2 x the product of every letter's size (a
    multiply and an add per term; for more than two operands, the cost without an intermediate)."""
    operands, _ = parse_equation(equation, len(shapes))
    n_ell = max(
        (len(shape) - (len(labels) - 1) for labels, shape in zip(operands, shapes) if _ELLIPSIS in labels),
        default=0,
    )
    size: dict[str, int] = {}
    for labels, shape in zip(operands, shapes):
        for ident, n in zip(_expand(labels, len(shape), n_ell), shape):
            size[ident] = max(size.get(ident, 1), n)
    total = 2.0
    for n in size.values():
        total *= n
    return total


@rule("aten.einsum.default", "linear")
def einsum(call: OpCall) -> str:
    return einsum_annotation(call.arg(0, "equation"), [m.shape for m in call.inputs])
