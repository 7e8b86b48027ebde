"""Functional writes: a base tensor with some of its values replaced (what torch's functionalization
makes of `x[:, 1:] = y`, `x.fill_(0)`, `x.scatter_(...)`, `x[idx] = v`).

The written positions run along one dim (or a few, for index_put and diagonal_scatter): those dims
stay whole (`^`). Every other dim splits alike in the base, the written values and the result, so
each device writes its own part of the base. Overwrites of the whole base (copy, fill, zero) are
elementwise: every dim splits.
"""

from __future__ import annotations

from nnscaler.graph.ir import SymExpr
from nnscaler.graph.ops._letters import broadcast_inputs, letters
from nnscaler.graph.ops.registry import OpCall, rule

__all__: list[str] = []

_MAXINT = 9223372036854775807


def _frozen(ids: list[str], dims: set[int]) -> list[str]:
    return [x + "^" if i in dims else x for i, x in enumerate(ids)]


@rule(
    ["aten.copy.default", "aten.copy_.default", "aten.fill.Scalar", "aten.fill.Tensor", "aten.zero.default"],
    "elementwise",
)
def overwrite(call: OpCall) -> str:
    """The result has the base's shape and dtype; copy's source broadcasts into it, fill's value is a
    0-d tensor or a number: 'a b c, 1 c -> a b c'."""
    out = call.outputs[0].shape
    out_ids = letters(len(out))
    ins = broadcast_inputs(out, [m.shape for m in call.inputs], out_ids)
    return ", ".join(ins) + " -> " + " ".join(out_ids)


def _whole_dim(call: OpCall, dim: int) -> bool:
    """Does slice_scatter's slice cover the whole dim (start 0, step 1, end at or past the size)?"""
    size = call.inputs[0].shape[dim]
    start, end, step = call.arg(3, "start"), call.arg(4, "end"), call.arg(5, "step", 1)
    if start not in (None, 0) or step not in (None, 1) or call.inputs[1].shape[dim] != size:
        return False
    if end is None or (isinstance(end, int) and end >= size):
        return True
    sym = call.inputs[0].sym
    return isinstance(end, SymExpr) and sym is not None and sym[dim] == end.code


@rule("aten.slice_scatter.default", "scatter")
def slice_scatter(call: OpCall) -> str:
    """base[..., start:end:step, ...] = src along `dim`: 'a b^ c, a b_src^ c -> a b^ c' (dim 1).
    A slice that covers the whole dim (the result is src) splits on it too."""
    shape = call.inputs[0].shape
    dim = call.arg(2, "dim", 0) % len(shape)
    ids = letters(len(shape))
    if _whole_dim(call, dim):
        text = " ".join(ids)
        return f"{text}, {text} -> {text}"
    src = [f"{x}_src^" if i == dim else x for i, x in enumerate(ids)]
    base = " ".join(_frozen(ids, {dim}))
    return f"{base}, {' '.join(src)} -> {base}"


@rule("aten.select_scatter.default", "scatter")
def select_scatter(call: OpCall) -> str:
    """base.select(dim, index) = src: 'a b^ c, a c -> a b^ c' (dim 1)."""
    shape = call.inputs[0].shape
    dim = call.arg(2, "dim") % len(shape)
    ids = letters(len(shape))
    base = " ".join(_frozen(ids, {dim}))
    return f"{base}, {' '.join(x for i, x in enumerate(ids) if i != dim)} -> {base}"


@rule("aten.diagonal_scatter.default", "scatter")
def diagonal_scatter(call: OpCall) -> str:
    """base.diagonal(offset, dim1, dim2) = src; src holds the other dims, then the diagonal:
    'a^ b^ c, c d^ -> a^ b^ c' (dims 0 and 1)."""
    shape = call.inputs[0].shape
    rank = len(shape)
    dims = {call.arg(3, "dim1", 0) % rank, call.arg(4, "dim2", 1) % rank}
    ids = letters(rank)
    base = " ".join(_frozen(ids, dims))
    src = [x for i, x in enumerate(ids) if i not in dims] + ["diag^"]
    return f"{base}, {' '.join(src)} -> {base}"


@rule("aten.as_strided_scatter.default", "scatter")
def as_strided_scatter(call: OpCall) -> str:
    """Writes through arbitrary strides: kept whole."""
    base = " ".join(x + "^" for x in letters(len(call.inputs[0].shape)))
    src = " ".join(f"{x}_src^" for x in letters(len(call.inputs[1].shape)))
    return f"{base}, {src} -> {base}"


@rule(
    [
        "aten.scatter.src",
        "aten.scatter.value",
        "aten.scatter.reduce",
        "aten.scatter.value_reduce",
        "aten.scatter_add.default",
        "aten.scatter_reduce.two",
    ],
    "scatter",
)
def scatter(call: OpCall) -> str:
    """base[index[i][j]][j] = src[i][j] along `dim` (here 0). A dim other than `dim` splits where the
    index (and src) span all of the base's: 'a^ b, a_index^ b, a_src^ b -> a^ b'. Where they are
    shorter (only the first rows are written), it stays whole too."""
    shape = call.inputs[0].shape
    rank = len(shape)
    dim = call.arg(1, "dim") % max(rank, 1)
    others = [m.shape for m in call.inputs[1:]]  # index, then src for the tensor variants
    ids = letters(rank)
    base, rest = [], [[] for _ in others]
    for i, x in enumerate(ids):
        shared = i != dim and all(s[i] == shape[i] for s in others)
        base.append(x if shared else x + "^")
        for k, texts in enumerate(rest):
            texts.append(x if shared else f"{x}_{('index', 'src')[k]}^")
    texts = [" ".join(base)] + [" ".join(t) for t in rest]
    return ", ".join(texts) + " -> " + " ".join(base)


@rule(["aten.index_copy.default", "aten.index_add.default"], "scatter")
def index_copy(call: OpCall) -> str:
    """base.index_copy(dim, index, source): rows of `dim` replaced (or added to); the other dims split
    alike in base and source: 'a b^ c, b_index^, a b_src^ c -> a b^ c'."""
    shape = call.inputs[0].shape
    rank = len(shape)
    dim = call.arg(1, "dim") % max(rank, 1)
    ids = letters(rank)
    base = " ".join(_frozen(ids, {dim}))
    index = " ".join(f"{x}_index^" for x in letters(len(call.inputs[1].shape), rank))
    src = " ".join(f"{x}_src^" if i == dim else x for i, x in enumerate(ids))
    return f"{base}, {index}, {src} -> {base}"


def _advanced(call: OpCall) -> tuple[list[int], list[tuple[str, int]], list[int]]:
    """index_put's indexing: the base dims its index tensors cover, the dims of `base[indices]` (the
    shape the values broadcast to: ('base', d) or ('index', k)), and the rank of each index tensor.

    An integer index covers one dim, a boolean mask as many as it has; together they give the
    broadcast index dims, which stand where the indexed dims were when the index tensors are
    adjacent in `indices`, and first otherwise (numpy's rule)."""
    rank = len(call.inputs[0].shape)
    metas = iter(call.inputs[1:])
    covered: list[int] = []
    tensor_at: list[int] = []  # positions in `indices` holding a tensor
    index_ranks: list[int] = []
    index_rank, pos = 0, 0
    for k, entry in enumerate(call.arg(1, "indices")):
        if entry is None:
            pos += 1
            continue
        meta = next(metas)
        mask = meta.dtype in ("bool", "uint8")
        width = len(meta.shape) if mask else 1
        index_ranks.append(len(meta.shape))
        tensor_at.append(k)
        index_rank = max(index_rank, 1 if mask else len(meta.shape))
        covered.extend(range(pos, pos + width))
        pos += width
    kept = [("base", d) for d in range(rank) if d not in covered]
    index_dims = [("index", k) for k in range(index_rank)]
    adjacent = bool(tensor_at) and tensor_at == list(range(tensor_at[0], tensor_at[-1] + 1))
    if adjacent and covered:
        before = [e for e in kept if e[1] < covered[0]]
        return covered, before + index_dims + kept[len(before) :], index_ranks
    return covered, index_dims + kept, index_ranks


@rule("aten.index_put.default", "scatter")
def index_put(call: OpCall) -> str:
    """base[indices] = values (accumulate: +=). The dims the index tensors cover stay whole; every
    other base dim splits, with the values where they broadcast to it: base[:, idx] = v is
    'a b^ c, idx0_0^, a val1^ c -> a b^ c'. The index tensors stay whole."""
    shape = call.inputs[0].shape
    covered, result, index_ranks = _advanced(call)
    ids = letters(len(shape))
    base = " ".join(_frozen(ids, set(covered)))
    index_texts = [" ".join(f"idx{k}_{j}^" for j in range(r)) for k, r in enumerate(index_ranks)]
    values = call.inputs[-1].shape
    value_ids = []
    for v, size in enumerate(values):
        at = len(result) - len(values) + v
        kind, d = result[at] if at >= 0 else ("none", -1)
        if kind == "base" and size == shape[d]:
            value_ids.append(ids[d])
        elif size == 1:
            value_ids.append("1")
        else:
            value_ids.append(f"val{v}^")
    return ", ".join([base, *index_texts, " ".join(value_ids)]) + " -> " + base
