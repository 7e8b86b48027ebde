"""Views and data movement: reshape (grouped sub-dims), transpose, slicing, concatenation, indexing."""

from __future__ import annotations

from itertools import accumulate
from operator import mul

from nnscaler.graph.ops._letters import broadcast_inputs, letters
from nnscaler.graph.ops.registry import OpCall, rule


def _groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]] | None:
    """Pair runs of src dims with runs of dst dims of equal product (size-1 dims get their own group)."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            groups.append(([i], []))
            i += 1
            continue
        if j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            groups.append(([], [j]))
            j += 1
            continue
        if i >= len(src) or j >= len(dst):
            return None
        gi, gj, pi, pj = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                if i >= len(src):
                    return None
                gi.append(i)
                pi *= src[i]
                i += 1
            else:
                if j >= len(dst):
                    return None
                gj.append(j)
                pj *= dst[j]
                j += 1
        groups.append((gi, gj))
    return groups


@rule(
    [
        "aten.view.default",
        "aten.reshape.default",
        "aten._unsafe_view.default",
        "aten.flatten.using_ints",
        "aten.unflatten.int",
        "aten.squeeze.dim",
        "aten.squeeze.dims",
        "aten.squeeze.default",
        "aten.unsqueeze.default",
        "aten.view_as.default",
        "aten.reshape_as.default",
    ],
    "view",
    shape_args=True,
)
def reshape(call: OpCall) -> tuple[str, dict[str, int]]:
    src, dst = call.inputs[0].shape, call.outputs[0].shape
    groups = _groups(src, dst)
    in_ids: list[str] = [""] * len(src)
    out_ids: list[str] = [""] * len(dst)
    sizes: dict[str, int] = {}
    if groups is None:  # no factorisation: nothing splits
        ids = letters(len(src) + len(dst))
        out_text = " ".join(x + "^" for x in ids[len(src) :])
        return (
            " ".join(x + "^" for x in ids[: len(src)]) + _shape_from(call, out_text) + " -> " + out_text,
            dict(zip(ids, list(src) + list(dst))),
        )
    names = iter(letters(len(src) + len(dst) + 2))
    for gi, gj in groups:
        if not gi or not gj:
            for i in gi:
                in_ids[i] = "1"
            for j in gj:
                out_ids[j] = "1"
            continue
        if len(gi) == 1 or len(gj) == 1:
            fine, coarse, fine_idx, coarse_idx, fine_ids = (
                (gj, gi, dst, src, out_ids) if len(gi) == 1 else (gi, gj, src, dst, in_ids)
            )
            subs = [next(names) for _ in fine]
            for k, d in zip(subs, fine):
                sizes[k] = fine_idx[d]
                fine_ids[d] = k
            composite = "(" + " ".join(subs) + ")" if len(subs) > 1 else subs[0]
            target = out_ids if fine_ids is in_ids else in_ids
            target[coarse[0]] = composite
        else:  # many-to-many: the sub-dims both sides agree on, e.g. 'b (h d) -> (b h) d'; else whole
            refined = _refine([src[i] for i in gi], [dst[j] for j in gj])
            if refined is not None:
                subs = [next(names) for _ in refined[2]]
                sizes.update(zip(subs, refined[2]))
                for ids, dims, parts in ((in_ids, gi, refined[0]), (out_ids, gj, refined[1])):
                    for d, (lo, hi) in zip(dims, parts):
                        ids[d] = subs[lo] if hi - lo == 1 else "(" + " ".join(subs[lo:hi]) + ")"
                continue
            for i in gi:
                in_ids[i] = next(names) + "^"
                sizes[in_ids[i][:-1]] = src[i]
            for j in gj:
                out_ids[j] = next(names) + "^"
                sizes[out_ids[j][:-1]] = dst[j]
    for i in _squeeze_kept(call):
        in_ids[i] += "" if in_ids[i].endswith("^") else "^"
    out_text = " ".join(out_ids)
    return " ".join(in_ids) + _shape_from(call, out_text) + " -> " + out_text, sizes


def _refine(
    a: list[int], b: list[int]
) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[int]] | None:
    """The common refinement of two factorisations of one size: the sub-dim sizes, and for each dim of
    `a` and of `b` its range of sub-dims; None when one side's boundary does not divide the other's
    (a (4, 6) -> (6, 4) reshape has no common sub-dims) or a dim is 1."""
    if 1 in a or 1 in b:
        return None
    cuts = sorted(set(accumulate(a, mul)) | set(accumulate(b, mul)))
    subs, prev = [], 1
    for cut in cuts:
        if cut % prev:
            return None
        subs.append(cut // prev)
        prev = cut

    def ranges(sizes: list[int]) -> list[tuple[int, int]]:
        out, k = [], 0
        for size in sizes:
            lo, prod = k, 1
            while prod < size:
                prod *= subs[k]
                k += 1
            out.append((lo, k))
        return out

    return ranges(a), ranges(b), subs


def _squeeze_kept(call: OpCall) -> list[int]:
    """Dims a squeeze names (all for squeeze()) that it keeps, being larger than 1: split to 1 per
    device, the local squeeze would drop them, so they stay whole."""
    shape = call.inputs[0].shape
    op = call.node.op
    if not shape:
        return []
    if op == "aten.squeeze.default":
        named = range(len(shape))
    elif op in ("aten.squeeze.dim", "aten.squeeze.dims"):
        dims = call.arg(1, "dim")
        named = [d % len(shape) for d in ([dims] if isinstance(dims, int) else dims)]
    else:
        return []
    return [d for d in named if shape[d] != 1]


def _shape_from(call: OpCall, out_text: str) -> str:
    """view_as / reshape_as / expand_as take the output shape from a second tensor of that shape: it
    splits as the output does, so the local op gets the local shape."""
    return f", {out_text}" if len(call.inputs) > 1 else ""


@rule(["aten.expand.default", "aten.expand_as.default"], "view", shape_args=True)
def expand(call: OpCall) -> str:
    src, dst = call.inputs[0].shape, call.outputs[0].shape
    out_ids = letters(len(dst))
    offset = len(dst) - len(src)
    in_ids = [("1" if s == 1 and dst[i + offset] != 1 else out_ids[i + offset]) for i, s in enumerate(src)]
    out_text = " ".join(out_ids)
    return " ".join(in_ids) + _shape_from(call, out_text) + " -> " + out_text


_LAST_TWO = ("aten.mT.default", "aten.mH.default", "aten.adjoint.default", "aten.matrix_H.default")
"""Swap the last two dims (the H ones conjugate too: elementwise)."""


@rule(
    [
        "aten.transpose.int",
        "aten.permute.default",
        "aten.t.default",
        "aten.movedim.int",
        "aten.swapaxes.default",
        "aten.swapdims.default",
        "aten.numpy_T.default",  # x.T: every dim reversed
        *_LAST_TWO,
    ],
    "view",
)
def permute(call: OpCall) -> str:
    rank = len(call.inputs[0].shape)
    ids = letters(rank)
    op = call.node.op
    if op in _LAST_TWO:
        out = list(ids)
        out[-2], out[-1] = out[-1], out[-2]
    elif op in ("aten.transpose.int", "aten.movedim.int", "aten.swapaxes.default", "aten.swapdims.default"):
        a, b = call.args[1] % max(rank, 1), call.args[2] % max(rank, 1)
        out = list(ids)
        if op != "aten.movedim.int":
            out[a], out[b] = out[b], out[a]
        else:
            out.insert(b, out.pop(a))
    elif op in ("aten.t.default", "aten.numpy_T.default"):
        out = list(reversed(ids))
    else:
        out = [ids[d % rank] for d in call.args[1]]
    return " ".join(ids) + " -> " + " ".join(out)


def _block_dim(call: OpCall, dim: int, pieces: int) -> str:
    """Input annotation for a tensor cut into `pieces` equal chunks along `dim`: '(k c)' splits on c."""
    shape = call.inputs[0].shape
    ids = letters(len(shape))
    in_ids = list(ids)
    in_ids[dim] = f"({pieces} {ids[dim]})" if pieces > 1 else ids[dim]
    return " ".join(in_ids) + " -> " + ", ".join(" ".join(ids) for _ in range(len(call.outputs)))


_SPLITS = [
    "aten.split.Tensor",
    "aten.chunk.default",
    "aten.split_with_sizes.default",
    "aten.unbind.int",
    "aten.tensor_split.sections",
    "aten.tensor_split.indices",
]


@rule(_SPLITS, "view")
def split(call: OpCall) -> str:
    """Pieces along one dim. Equal pieces that cover it: '(k c) -> c, c, ...', so the dim itself may
    be split (each device keeps its part of every piece; split sizes are localised). Unequal pieces
    (torch.split(x, [16, 24, 24], -1)): the cut dim stays whole, each piece has its own identifier
    for it ('c^ -> c_0^, c_1^, c_2^'), and every other dim splits alike in the input and all pieces.
    unbind drops the dim: 'a b^ c -> a c, a c'."""
    shape = call.inputs[0].shape
    op = call.node.op
    dim = (call.arg(1, "dim", 0) if op == "aten.unbind.int" else call.arg(2, "dim", 0)) % len(shape)
    ids = letters(len(shape))
    outs = [m.shape for m in call.outputs]
    if op == "aten.unbind.int":
        in_ids = [x + ("^" if i == dim else "") for i, x in enumerate(ids)]
        piece = " ".join(x for i, x in enumerate(ids) if i != dim)
        return " ".join(in_ids) + " -> " + ", ".join(piece for _ in outs)
    sizes = [o[dim] for o in outs]
    equal = len(set(sizes)) == 1 and sizes[0] * len(outs) == shape[dim]
    if equal and op != "aten.tensor_split.indices":
        return _block_dim(call, dim, len(outs))
    in_ids = [x + ("^" if i == dim else "") for i, x in enumerate(ids)]
    pieces = []
    for k in range(len(outs)):
        pieces.append(" ".join(f"{x}_{k}^" if i == dim else x for i, x in enumerate(ids)))
    return " ".join(in_ids) + " -> " + ", ".join(pieces)


def _dim_frozen(call: OpCall, dim: int, in_rank: int, out_rank: int) -> str:
    ids = letters(max(in_rank, out_rank))
    in_ids = [x + ("^" if i == dim else "") for i, x in enumerate(ids[:in_rank])]
    out_ids = [x + ("^" if i == dim else "") for i, x in enumerate(ids[:out_rank])]
    if in_rank == out_rank:
        # sizes along `dim` differ between in and out: give the output its own identifier
        out_ids[dim] = "z^"
    return " ".join(in_ids) + " -> " + " ".join(out_ids)


@rule(["aten.slice.Tensor", "aten.narrow.default"], "view")
def slice_(call: OpCall) -> str:
    shape = call.inputs[0].shape
    dim = call.arg(1, "dim", 0) % len(shape)
    if call.outputs[0].shape == shape:
        ids = letters(len(shape))
        return " ".join(ids) + " -> " + " ".join(ids)
    return _dim_frozen(call, dim, len(shape), len(shape))


@rule("aten.select.int", "view")
def select(call: OpCall) -> str:
    shape = call.inputs[0].shape
    dim = call.args[1] % len(shape)
    ids = letters(len(shape))
    in_ids = [x + ("^" if i == dim else "") for i, x in enumerate(ids)]
    out_ids = [x for i, x in enumerate(ids) if i != dim]
    return " ".join(in_ids) + " -> " + " ".join(out_ids)


@rule(["aten.cat.default", "aten.stack.default"], "view")
def cat(call: OpCall) -> str:
    out = call.outputs[0].shape
    dim = call.arg(1, "dim", 0) % len(out)
    ids = letters(len(out))
    texts = []
    for k in range(len(call.inputs)):
        if call.node.op == "aten.stack.default":
            in_ids = [x for i, x in enumerate(ids) if i != dim]
        else:
            in_ids = [(f"c{k}^" if i == dim else x) for i, x in enumerate(ids)]
        texts.append(" ".join(in_ids))
    out_ids = [(x + "^" if i == dim else x) for i, x in enumerate(ids)]
    return ", ".join(texts) + " -> " + " ".join(out_ids)


@rule("aten.index.Tensor", "view")
def index(call: OpCall) -> str:
    """x[:, :, idx]: the dims the index tensors address stay whole, the others split as in x, and the
    index tensors' (broadcast) dims split as the output's. Adjacent indexed dims put the index dims in
    their place, indexed dims apart put them first (as torch does). Bool masks (sizes that depend on
    the data) keep everything whole."""
    x = call.inputs[0].shape
    indices = list(call.arg(1, "indices", []))
    tensors = call.inputs[1:]
    where = [k for k, i in enumerate(indices) if i is not None]
    if not where or len(where) != len(tensors) or any(m.dtype in ("bool", "uint8") for m in tensors):
        return whole(call)
    ids = letters(len(x))
    out = call.outputs[0].shape
    kept = [x_id for k, x_id in enumerate(ids) if k not in where]
    idx_ids = letters(len(out) - len(kept), len(x))
    first = where[0] if where == list(range(where[0], where[-1] + 1)) else 0  # where the index dims go
    idx_texts = broadcast_inputs(
        tuple(out[first : first + len(idx_ids)]), [m.shape for m in tensors], idx_ids
    )
    x_text = " ".join(x_id + ("^" if k in where else "") for k, x_id in enumerate(ids))
    out_ids = [x_id for k, x_id in enumerate(ids) if k < first and k not in where]
    out_ids += idx_ids + [x_id for k, x_id in enumerate(ids) if k >= first and k not in where]
    return ", ".join([x_text, *idx_texts]) + " -> " + " ".join(out_ids)


@rule(
    [
        "aten.diff.default",
        "aten.repeat.default",
        "aten.repeat_interleave.self_int",
        "aten.nonzero.default",
        "aten.sort.default",
        "aten.histc.default",
        "aten.index_put_.default",
        "aten.bincount.default",
        "aten.searchsorted.Tensor",
        "aten.masked_scatter.default",
        "aten.argsort.default",
        "aten.one_hot.default",
    ],
    "view",
)
def whole(call: OpCall) -> str:
    """Ops whose indexing ties all dims together: computed whole (replicated)."""
    ins = [" ".join(x + "^" for x in letters(len(m.shape), 10 * k)) for k, m in enumerate(call.inputs)]
    outs = [
        " ".join(x + "^" for x in letters(len(m.shape), 10 * (k + len(call.inputs)))) if m else "?"
        for k, m in enumerate(call.outputs)
    ]
    return ", ".join(ins) + " -> " + ", ".join(outs)
