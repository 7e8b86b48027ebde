"""The dim-annotation language, e.g. linear: "* k+, n k+ -> * n".

Same identifier = same size. A plain dim may be split (outputs split the same way); `+` marks a
reduction dim (splitting it leaves outputs as partial sums); `^` marks a dim that must not be split;
a number is a fixed-size dim (never split); `*` stands for any number of leading dims; `?` marks a
non-tensor or replicate-only argument; `(h d)` is one dim made of sub-dims: splitting the first is a
contiguous split, splitting a later one a strided split (see Shard.blocks).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["DimAnno", "TensorAnno", "OpAnno", "parse_annotation", "AnnotationError"]

_ID = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\d+")


class AnnotationError(ValueError):
    """An annotation string is malformed or does not fit the op's shapes."""


@dataclass(frozen=True)
class DimAnno:
    """One tensor dim: one identifier, or several for a composite `(h d)` dim."""

    ids: tuple[str, ...]
    flags: tuple[str, ...]  # '' | '+' | '^' for each identifier

    def __str__(self) -> str:
        parts = [i + f for i, f in zip(self.ids, self.flags)]
        return parts[0] if len(parts) == 1 else "(" + " ".join(parts) + ")"


@dataclass(frozen=True)
class TensorAnno:
    """The dims of one tensor, or None for `?` (non-tensor / replicate-only)."""

    dims: tuple[DimAnno, ...] | None

    def __str__(self) -> str:
        return "?" if self.dims is None else " ".join(str(d) for d in self.dims)

    def ids(self) -> list[str]:
        return [] if self.dims is None else [i for d in self.dims for i in d.ids]


@dataclass(frozen=True)
class OpAnno:
    inputs: tuple[TensorAnno, ...]
    outputs: tuple[TensorAnno, ...]

    def __str__(self) -> str:
        return ", ".join(map(str, self.inputs)) + " -> " + ", ".join(map(str, self.outputs))

    def flag_of(self, ident: str) -> str:
        """The flag an identifier carries anywhere in the annotation ('^' wins over '+' over '');
        once per identifier of this (frozen) annotation, kept beside its fields (no part of eq)."""
        memo = self.__dict__.setdefault("_flags", {})
        if ident not in memo:
            memo[ident] = self._flag_of(ident)
        return memo[ident]

    def _flag_of(self, ident: str) -> str:
        flags = {
            f
            for t in self.inputs + self.outputs
            if t.dims
            for d in t.dims
            for i, f in zip(d.ids, d.flags)
            if i == ident
        }
        if ident.isdigit() or "^" in flags:
            return "^"
        return "+" if "+" in flags else ""

    def identifiers(self) -> list[str]:
        seen: dict[str, None] = {}
        for t in self.inputs + self.outputs:
            for i in t.ids():
                seen.setdefault(i)
        return list(seen)


def _parse_tensor(text: str) -> TensorAnno:
    text = text.strip()
    if text == "?":
        return TensorAnno(None)
    dims: list[DimAnno] = []
    pos = 0
    while pos < len(text):
        ch = text[pos]
        if ch.isspace():
            pos += 1
            continue
        if ch == "(":
            end = text.index(")", pos)
            inner = [_parse_id(tok) for tok in text[pos + 1 : end].split()]
            if not inner:
                raise AnnotationError(f"empty group in {text!r}")
            dims.append(DimAnno(tuple(i for i, _ in inner), tuple(f for _, f in inner)))
            pos = end + 1
            continue
        end = pos
        while end < len(text) and not text[end].isspace() and text[end] != "(":
            end += 1
        ident, flag = _parse_id(text[pos:end])
        dims.append(DimAnno((ident,), (flag,)))
        pos = end
    return TensorAnno(tuple(dims))


def _parse_id(token: str) -> tuple[str, str]:
    flag = ""
    if token and token[-1] in "+^":
        token, flag = token[:-1], token[-1]
    if token != "*" and not _ID.fullmatch(token):
        raise AnnotationError(f"bad dim identifier {token!r}")
    return token, flag


def parse_annotation(text: str) -> OpAnno:
    """Parse 'in1, in2 -> out' into an OpAnno (no `*` expansion)."""
    if "->" not in text:
        raise AnnotationError(f"annotation {text!r} has no '->'")
    lhs, rhs = text.split("->")
    inputs = tuple(_parse_tensor(t) for t in lhs.split(",")) if lhs.strip() else ()
    outputs = tuple(_parse_tensor(t) for t in rhs.split(","))
    return OpAnno(inputs, outputs)
