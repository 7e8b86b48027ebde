"""Views and data movement: reshape (grouped sub-dims), transpose, slicing, concatenation, indexing."""

from __future__ import annotations

from nnscaler.graph.ops._letters import letters
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
        return (
            " ".join(x + "^" for x in ids[: len(src)]) + " -> " + " ".join(x + "^" for x in ids[len(src) :]),
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
        else:  # many-to-many: keep whole
            for i in gi:
                in_ids[i] = next(names) + "^"
                sizes[in_ids[i][:-1]] = src[i]
            for j in gj:
                out_ids[j] = next(names) + "^"
                sizes[out_ids[j][:-1]] = dst[j]
    return " ".join(in_ids) + " -> " + " ".join(out_ids), sizes


@rule(["aten.expand.default", "aten.expand_as.default"], "view", shape_args=True)
def expand(call: OpCall) -> str:
    src, dst = call.inputs[0].shape, call.outputs[0].shape
    out_ids = letters(len(dst))
    offset = len(dst) - len(src)
    in_ids = [("1" if s == 1 and dst[i + offset] != 1 else out_ids[i + offset]) for i, s in enumerate(src)]
    ins = [" ".join(in_ids)] + (["?"] if len(call.inputs) > 1 else [])
    return ", ".join(ins) + " -> " + " ".join(out_ids)


@rule(["aten.transpose.int", "aten.permute.default", "aten.t.default", "aten.movedim.int"], "view")
def permute(call: OpCall) -> str:
    rank = len(call.inputs[0].shape)
    ids = letters(rank)
    op = call.node.op
    if op == "aten.transpose.int" or op == "aten.movedim.int":
        a, b = call.args[1] % max(rank, 1), call.args[2] % max(rank, 1)
        out = list(ids)
        if op == "aten.transpose.int":
            out[a], out[b] = out[b], out[a]
        else:
            out.insert(b, out.pop(a))
    elif op == "aten.t.default":
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


@rule(["aten.split.Tensor", "aten.chunk.default", "aten.split_with_sizes.default", "aten.unbind.int"], "view")
def split(call: OpCall) -> str:
    shape = call.inputs[0].shape
    dim = call.arg(2, "dim", 0) if call.node.op != "aten.unbind.int" else call.arg(1, "dim", 0)
    dim %= len(shape)
    outs = [m.shape for m in call.outputs]
    if (
        call.node.op == "aten.unbind.int"
        or len({o[dim] for o in outs}) != 1
        or outs[0][dim] * len(outs) != shape[dim]
    ):
        ids = letters(len(shape))
        in_ids = [x + ("^" if i == dim else "") for i, x in enumerate(ids)]
        outs_text = [
            " ".join(x + ("^" if i == dim else "") for i, x in enumerate(letters(len(o), 20))) for o in outs
        ]
        return " ".join(in_ids) + " -> " + ", ".join(outs_text)
    return _block_dim(call, dim, len(outs))


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


@rule(
    [
        "aten.index.Tensor",
        "aten.gather.default",
        "aten.index_select.default",
        "aten.diff.default",
        "aten.pad.default",
        "aten.constant_pad_nd.default",
        "aten.roll.default",
        "aten.flip.default",
        "aten.repeat.default",
        "aten.repeat_interleave.self_int",
        "aten.scatter.src",
        "aten.scatter_add.default",
        "aten.nonzero.default",
        "aten.topk.default",
        "aten.sort.default",
        "aten.histc.default",
        "aten.index_put.default",
        "aten.index_put_.default",
        "aten.bincount.default",
        "aten.searchsorted.Tensor",
        "aten.index_add.default",
        "aten.index_copy.default",
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
