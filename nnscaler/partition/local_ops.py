"""The local call of a split op where it is not the op on local shards: shape arguments divided by
the split, and vocabulary-parallel embedding / cross entropy with the groups they reduce over."""

from __future__ import annotations

from typing import Any

from nnscaler.errors import PartitionError
from nnscaler.graph.ir import Graph, Node, iter_refs, sym_floordiv
from nnscaler.partition.convert import GROUP, AxisGroup
from nnscaler.partition.program import RankScaled, Statement

__all__ = ["local_size", "localise_dim", "group_of", "vocab_parallel_statement"]

_SHAPE_ARG_OPS = {
    "aten.view.default",
    "aten.reshape.default",
    "aten._unsafe_view.default",
    "aten.expand.default",
}
_CE_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def local_size(size, ways: int):
    """This rank's share of a size argument; -1 (inferred) stays -1."""
    return size if isinstance(size, int) and size == -1 else sym_floordiv(size, ways)


def localise_dim(graph: Graph, node: Node, args: tuple, d: int, ways: int) -> tuple:
    """`args` of `node` with the size arguments of output dim `d`, split `ways` ways, made local."""
    if node.op in _SHAPE_ARG_OPS:
        sizes = list(args[1])
        sizes[d] = local_size(sizes[d], ways)
        return (args[0], sizes, *args[2:])
    if node.op == "aten.unflatten.int":
        dim, sizes = args[1], list(args[2])
        dim %= len(graph.values[node.input_names()[0]].meta.shape)
        if dim <= d < dim + len(sizes):
            sizes[d - dim] = local_size(sizes[d - dim], ways)
        return (args[0], dim, sizes, *args[3:])
    if node.op in ("aten.split.Tensor", "aten.split_with_sizes.default"):
        dim = (args[2] if len(args) > 2 else 0) % len(graph.values[node.outputs[0]].meta.shape)
        if dim == d:  # equal pieces, each split alike: every size is this rank's share
            size = args[1]
            local = (
                [local_size(s, ways) for s in size]
                if isinstance(size, (list, tuple))
                else local_size(size, ways)
            )
            return (args[0], local, *args[2:])
    return args


def group_of(axes, mesh: tuple[int, ...]) -> object:
    """The group spanning the given split axes (-1 or all of them: the whole group)."""
    axes = sorted(axes)
    if axes == [-1] or len(axes) == len(mesh):
        return GROUP
    if len(axes) == 1:
        return AxisGroup(axes[0])
    raise PartitionError(f"no group spans mesh axes {axes} of mesh {mesh}")


def _arg(args: Any, kwargs: dict, index: int, name: str, default: Any) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def _loss_options(args: Any, kwargs: dict) -> dict[str, Any]:
    ignore = args[4] if len(args) > 4 else kwargs.get("ignore_index", -100)
    reduction = _CE_REDUCTIONS[args[3] if len(args) > 3 else kwargs.get("reduction", 1)]
    return {"ignore_index": ignore, "reduction": reduction}


def vocab_parallel_statement(
    node: Node, specials: dict, split_axes, bound, args, kwargs, common: dict, outputs: list[str], mesh
) -> Statement:
    """Vocab-parallel embedding / cross entropy over the axis that splits the vocabulary (the whole
    group for a 1-D split); other mesh axes split other dims (the batch), which the local code keeps."""
    emits = {sp.emit: k for k, sp in specials.items()}
    refs = list(iter_refs((args, kwargs)))
    if set(emits) == {"batch_parallel_cross_entropy", "vocab_parallel_cross_entropy"}:
        vocab_axis, batch_axis = emits["vocab_parallel_cross_entropy"], emits["batch_parallel_cross_entropy"]
        ways = dict(split_axes)[vocab_axis][1]
        call_args = (
            refs[0],
            refs[1],
            RankScaled(bound.sizes["c"] // ways, vocab_axis),
            AxisGroup(vocab_axis),
            AxisGroup(batch_axis),
        )
        extra = _loss_options(args, kwargs)
        return Statement("special", "batch_vocab_parallel_cross_entropy", call_args, extra, outputs, **common)
    if len(specials) != 1:
        raise PartitionError(
            f"node {node.name} ({node.op}, {node.source}) has local code for one split at a time; "
            "split its vocabulary on one mesh axis"
        )
    ((axis, special),) = specials.items()
    ways = dict(split_axes)[axis][1]
    emit = special.emit
    group = group_of([axis], mesh)
    rank_axis = None if group is GROUP else axis
    if emit == "vocab_parallel_embedding":
        vocab = bound.sizes["v"]
        padding = args[2] if len(args) > 2 else kwargs.get("padding_idx", -1)
        extra = {"padding_idx": padding} if padding is not None and padding >= 0 else {}
        call_args = (refs[1], refs[0], RankScaled(vocab // ways, rank_axis))
    elif emit == "vocab_parallel_chunk_linear_cross_entropy":
        # hidden's gradient is summed over the group by the copy_to_group the partition puts on it
        extra = {"ignore_index": _arg(args, kwargs, 3, "ignore_index", -100)}
        extra.update(chunk_size=_arg(args, kwargs, 4, "chunk_size", 1024), sync_hidden_grad=False)
        call_args = (*refs[:3], RankScaled(bound.sizes["v"] // ways, rank_axis), group)
    else:
        extra = _loss_options(args, kwargs)
        if emit == "vocab_parallel_cross_entropy":
            call_args = (refs[0], refs[1], RankScaled(bound.sizes["c"] // ways, rank_axis), group)
        else:
            call_args = (refs[0], refs[1], group)
    return Statement("special", emit, call_args, extra, outputs, **common)
