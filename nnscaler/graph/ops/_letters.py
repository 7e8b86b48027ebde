"""Helpers that build annotations from traced shapes (broadcasting, reductions)."""

from __future__ import annotations

__all__ = ["letters", "dims_text", "broadcast_inputs"]

_ALPHABET = "abcdefghijklmnopqrstuvwxyz"


def letters(n: int, start: int = 0) -> list[str]:
    """n distinct identifiers: a, b, c, ... then a1, b1, ..."""
    out = []
    for i in range(start, start + n):
        out.append(_ALPHABET[i % 26] + (str(i // 26) if i >= 26 else ""))
    return out


def dims_text(ids: list[str]) -> str:
    return " ".join(ids)


def broadcast_inputs(
    out_shape: tuple[int, ...], in_shapes: list[tuple[int, ...]], out_ids: list[str]
) -> list[str]:
    """Annotate inputs that broadcast to out_shape: aligned right, size-1 dims against a larger size are '1'."""
    texts = []
    for shape in in_shapes:
        offset = len(out_shape) - len(shape)
        ids = []
        for i, size in enumerate(shape):
            j = i + offset
            ids.append("1" if size == 1 and out_shape[j] != 1 else out_ids[j])
        texts.append(" ".join(ids))
    return texts
