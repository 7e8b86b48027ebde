"""Data movement along some dims only (pad, roll, flip, index_select): the dims it touches stay whole, the
others split freely. Until these rules, such ops kept every dim whole, so a padded window attention
(Swin) or a padded chunked scan (Mamba2) ran whole under every splitting policy."""

from __future__ import annotations

from typing import Any

from nnscaler.graph.ops._letters import letters
from nnscaler.graph.ops.registry import OpCall, rule

__all__ = ["pad", "roll", "flip", "index_select"]


def _zero(value: Any) -> bool:
    """A pad amount known to be 0 (a size expression is taken as nonzero: its dim stays whole)."""
    return isinstance(value, int) and value == 0


@rule(["aten.pad.default", "aten.constant_pad_nd.default"], "view")
def pad(call: OpCall) -> str:
    """pad = (last dim's left, right, the dim before's left, right, ...): a padded dim changes size and
    its values move, so it stays whole (a new letter in the output); every other dim passes through."""
    shape = call.inputs[0].shape
    amounts = list(call.arg(1, "pad"))
    padded = set()
    for j in range(len(amounts) // 2):
        if not (_zero(amounts[2 * j]) and _zero(amounts[2 * j + 1])):
            padded.add(len(shape) - 1 - j)
    ids = letters(len(shape))
    new = letters(len(shape), len(shape))
    ins = [x + "^" if i in padded else x for i, x in enumerate(ids)]
    outs = [new[i] + "^" if i in padded else x for i, x in enumerate(ids)]
    return " ".join(ins) + " -> " + " ".join(outs)


def _moving(call: OpCall, dims: Any) -> str:
    shape = call.inputs[0].shape
    named = {d % len(shape) for d in ([dims] if isinstance(dims, int) else dims)}
    ids = [x + "^" if i in named else x for i, x in enumerate(letters(len(shape)))]
    return " ".join(ids) + " -> " + " ".join(ids)


@rule("aten.roll.default", "view")
def roll(call: OpCall) -> str:
    """Rolled dims stay whole; roll without dims rolls the flattened tensor: every dim whole."""
    shape = call.inputs[0].shape
    dims = call.arg(2, "dims", [])
    if not shape:
        return " -> "
    return _moving(call, dims if dims else list(range(len(shape))))


@rule("aten.flip.default", "view")
def flip(call: OpCall) -> str:
    if not call.inputs[0].shape:
        return " -> "
    return _moving(call, call.arg(1, "dims"))


@rule("aten.index_select.default", "view")
def index_select(call: OpCall) -> str:
    """x.index_select(dim, index): x's indexed dim stays whole; the index splits as the output's dim."""
    shape = call.inputs[0].shape
    if not shape:
        return " -> "
    dim = call.arg(1, "dim") % len(shape)
    ids = letters(len(shape))
    picked = letters(1, len(shape))[0]
    x = [i + "^" if k == dim else i for k, i in enumerate(ids)]
    out = [picked if k == dim else i for k, i in enumerate(ids)]
    return f"{' '.join(x)}, {picked} -> {' '.join(out)}"
