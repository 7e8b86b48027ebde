"""What splitting an op on one identifier means for the layouts of its inputs and outputs."""

from __future__ import annotations

from dataclasses import dataclass

from nnscaler.graph.ir import Layout, Partial, Replicate, Shard, mesh_layout
from nnscaler.graph.ops.bind import BoundAnno

__all__ = [
    "SplitLayouts",
    "split_layouts",
    "split_candidates",
    "layouts_for",
    "mesh_layouts_for",
    "is_bias_split",
]


@dataclass(frozen=True)
class SplitLayouts:
    inputs: list[Layout | None]  # None: a '?' input (non-tensor or replicate-only)
    outputs: list[Layout | None]


def _tensor_layout(
    dims, ident: str, blocks: int, sizes: dict[str, int], allow_fixed: bool = False
) -> Layout | None | str:
    """Shard/Replicate for one tensor, or an error string when the split cannot apply."""
    hits = [(i, d) for i, d in enumerate(dims) if ident in d.ids]
    if not hits:
        return None
    if len(hits) > 1:
        return f"identifier {ident!r} appears in two dims of one tensor"
    dim, d = hits[0]
    pos = d.ids.index(ident)
    if d.flags[pos] == "^" and not allow_fixed:
        return f"dim {dim} ('{d}') must not be split"
    before = 1
    for sub in d.ids[:pos]:
        before *= int(sub) if sub.isdigit() else sizes[sub]
    return Shard(dim, blocks * before)


def split_layouts(
    bound: BoundAnno, ident: str, ways: int, blocks: int = 1, allow_fixed: bool = False
) -> SplitLayouts | str:
    """Layouts when the op is split `ways` ways on `ident` (each of `blocks` blocks split), or why not.
    allow_fixed: split a `^` identifier too (a special whose local code makes it right).
    Kept on the (frozen) bound annotation: the tp and cp policies and the planner ask for the same
    split of the same node hundreds of thousands of times (Llama-3-405B's offline plan)."""
    memo = bound.__dict__.setdefault("_split_layouts", {})  # not a field: no part of eq or repr
    key = (ident, ways, blocks, allow_fixed)
    if key not in memo:
        memo[key] = _split_layouts(bound, ident, ways, blocks, allow_fixed)
    return memo[key]


def _split_layouts(
    bound: BoundAnno, ident: str, ways: int, blocks: int, allow_fixed: bool
) -> SplitLayouts | str:
    anno = bound.anno
    size = bound.sizes.get(ident)
    if size is None:
        return f"{ident!r} is not an identifier of '{anno}'"
    if anno.flag_of(ident) == "^" and not allow_fixed:
        return f"{ident!r} must not be split in '{anno}'"
    if size % (ways * blocks):
        return f"{ident!r} has size {size}, which {ways} devices ({blocks} blocks) do not divide"
    ins: list[Layout | None] = []
    for t in anno.inputs:
        if t.dims is None:
            ins.append(None)
            continue
        lay = _tensor_layout(t.dims, ident, blocks, bound.sizes, allow_fixed)
        if isinstance(lay, str):
            return lay
        ins.append(lay if lay is not None else Replicate())
    outs: list[Layout | None] = []
    reducing = anno.flag_of(ident) == "+"
    for t in anno.outputs:
        if t.dims is None:
            outs.append(None)
            continue
        lay = _tensor_layout(t.dims, ident, blocks, bound.sizes, allow_fixed)
        if isinstance(lay, str):
            return lay
        if lay is None:
            if not reducing:
                return f"output '{t}' does not carry {ident!r}, which is not a reduction dim"
            lay = Partial()
        outs.append(lay)
    return SplitLayouts(ins, outs)


def split_candidates(bound: BoundAnno, ways: int) -> list[str]:
    """Identifiers the op may be split on `ways` ways (in annotation order)."""
    out = []
    for ident in bound.anno.identifiers():
        if ident.isdigit() or ident not in bound.sizes:
            continue
        if not isinstance(split_layouts(bound, ident, ways), str):
            out.append(ident)
    return out


def layouts_for(bound: BoundAnno, rule, ident: str | None, ways: int, blocks: int = 1) -> SplitLayouts | str:
    """Layouts of a node split per (ident, ways, blocks), honouring the rule's specials and bias.

    Replicated (ident None or ways 1): every tensor input and output is Replicate.
    A split with special local code (vocab-parallel embedding, cross entropy) takes contiguous pieces.
    A split on a '+' dim of an op with a bias: the bias is added once after the reduction, so the
    output is Replicate (the local op runs without bias, then all-reduce, then the bias add).
    """
    if ident is None or ways == 1:
        return SplitLayouts(
            [None if t.dims is None else Replicate() for t in bound.anno.inputs],
            [None if t.dims is None else Replicate() for t in bound.anno.outputs],
        )
    special = rule.specials.get(ident) if rule is not None else None
    if special is not None and special.co_split is not None:
        return _co_split_layouts(bound, ident, special.co_split, ways, blocks)
    result = split_layouts(
        bound, ident, ways, blocks, allow_fixed=special is not None and special.splits_fixed
    )
    if isinstance(result, str):
        return result
    if special is not None and blocks > 1:
        # the helpers get this rank's contiguous range (vocab_start = rank * size / ways)
        return f"a split on {ident!r} runs {special.emit}, which takes contiguous pieces: blocks must be 1"
    if special is not None and special.output == "replicate":
        return SplitLayouts(result.inputs, [None if o is None else Replicate() for o in result.outputs])
    if rule is not None and rule.bias_input is not None and bound.anno.flag_of(ident) == "+":
        if rule.bias_input < len(result.inputs):
            return SplitLayouts(result.inputs, [Replicate() for _ in result.outputs])
    return result


def _co_split_layouts(bound: BoundAnno, ident: str, co: str, ways: int, blocks: int) -> SplitLayouts | str:
    """`ident` split on the tensors that carry it, `co` on the others and on the outputs."""
    size = bound.sizes.get(ident)
    if size is None or size % ways:
        return f"{ident!r} has size {size}, which {ways} devices do not divide"
    if blocks > 1:
        return f"a split on {ident!r} takes contiguous pieces: blocks must be 1"
    follow = split_layouts(bound, co, ways, allow_fixed=True)
    if isinstance(follow, str):
        return follow
    ins: list[Layout | None] = []
    for t, other in zip(bound.anno.inputs, follow.inputs):
        own = None if t.dims is None else _tensor_layout(t.dims, ident, 1, bound.sizes, allow_fixed=True)
        if isinstance(own, str):
            return own
        ins.append(own if own is not None else other)
    return SplitLayouts(ins, follow.outputs)


def is_bias_split(bound: BoundAnno, rule, ident: str | None, ways: int) -> bool:
    """True when the op is split on its reduction dim and has a bias to add after the reduction."""
    return (
        ident is not None
        and ways > 1
        and rule is not None
        and rule.bias_input is not None
        and rule.bias_input < len(bound.anno.inputs)
        and bound.anno.flag_of(ident) == "+"
    )


def mesh_layouts_for(
    bound: BoundAnno, rule, axes: tuple[tuple[str | None, int], ...], mesh: tuple[int, ...]
) -> SplitLayouts | str:
    """Layouts of a node split on one identifier per mesh axis (`axes`: (identifier or None, blocks)),
    or why it cannot be: each axis as `layouts_for` over that axis's devices, then put together."""
    if len(axes) != len(mesh):
        return f"{len(axes)} mesh splits for a mesh of {len(mesh)} axes {tuple(mesh)}"
    idents = [ident for ident, _ in axes if ident is not None]
    if len(set(idents)) != len(idents):
        return "one identifier split over two mesh axes is a 1-D split over their devices: use split/ways"
    per_axis = []
    for k, ((ident, blocks), size) in enumerate(zip(axes, mesh)):
        lay = layouts_for(bound, rule, ident, size, blocks)
        if isinstance(lay, str):
            return f"mesh axis {k} ({size} devices): {lay}"
        per_axis.append(lay)

    def combine(parts: list[Layout | None], what: str) -> Layout | None | str:
        if all(p is None for p in parts):
            return None
        placements = tuple(p if p is not None else Replicate() for p in parts)
        shards = [p for p in placements if isinstance(p, Shard)]
        if len({p.dim for p in shards}) < len(shards):
            return f"two mesh axes split the same dim of {what}"
        return mesh_layout(placements)

    ins, outs = [], []
    for i in range(len(per_axis[0].inputs)):
        lay = combine([la.inputs[i] for la in per_axis], f"input {i}")
        if isinstance(lay, str):
            return lay
        ins.append(lay)
    for i in range(len(per_axis[0].outputs)):
        lay = combine([la.outputs[i] for la in per_axis], f"output {i}")
        if isinstance(lay, str):
            return lay
        outs.append(lay)
    return SplitLayouts(ins, outs)
