"""Bind an annotation to actual shapes: expand `*`, learn each identifier's size, check traced shapes."""

from __future__ import annotations

from dataclasses import dataclass

from nnscaler.graph.ops.annotation import AnnotationError, DimAnno, OpAnno, TensorAnno

__all__ = ["BoundAnno", "bind_annotation"]

Shape = tuple[int, ...]


@dataclass(frozen=True)
class BoundAnno:
    """An annotation with `*` expanded and a size for every identifier."""

    anno: OpAnno
    sizes: dict[str, int]

    def __str__(self) -> str:
        return str(self.anno)


def _expand_star(t: TensorAnno, rank: int | None, star_count: int | None) -> tuple[TensorAnno, int | None]:
    if t.dims is None or not any(d.ids == ("*",) for d in t.dims):
        return t, star_count
    if rank is None:
        if star_count is None:
            raise AnnotationError("cannot expand '*' without a shape")
        n = star_count
    else:
        n = rank - (len(t.dims) - 1)
        if n < 0:
            raise AnnotationError(f"'{t}' needs at least {len(t.dims) - 1} dims, tensor has {rank}")
        if star_count is not None and n != star_count:
            raise AnnotationError(f"'*' stands for {star_count} dims in one tensor and {n} in another")
    dims: list[DimAnno] = []
    for d in t.dims:
        if d.ids == ("*",):
            dims.extend(DimAnno((f"_s{i}",), (d.flags[0],)) for i in range(n))
        else:
            dims.append(d)
    return TensorAnno(tuple(dims)), n


def _learn(t: TensorAnno, shape: Shape, sizes: dict[str, int], where: str) -> None:
    if t.dims is None:
        return
    if len(t.dims) != len(shape):
        raise AnnotationError(
            f"{where} '{t}' has {len(t.dims)} dims but the traced tensor has shape {list(shape)}"
        )
    for d, size in zip(t.dims, shape):
        known = 1
        unknown = []
        for ident in d.ids:
            if ident.isdigit():
                known *= int(ident)
            elif ident in sizes:
                known *= sizes[ident]
            else:
                unknown.append(ident)
        if len(unknown) == 1:
            if known == 0 or size % known:
                raise AnnotationError(f"{where} dim '{d}' of size {size} is not a multiple of {known}")
            sizes[unknown[0]] = size // known
        elif len(unknown) > 1:
            raise AnnotationError(f"{where} dim '{d}': sizes of {unknown} cannot be inferred; give them")
        elif known != size:
            raise AnnotationError(f"{where} dim '{d}' should have size {known} but the traced size is {size}")


def _infer(t: TensorAnno, sizes: dict[str, int]) -> Shape | None:
    if t.dims is None:
        return None
    out = []
    for d in t.dims:
        n = 1
        for ident in d.ids:
            if ident.isdigit():
                n *= int(ident)
            elif ident in sizes:
                n *= sizes[ident]
            else:
                return None
        out.append(n)
    return tuple(out)


def bind_annotation(
    anno: OpAnno,
    in_shapes: list[Shape | None],
    out_shapes: list[Shape | None],
    extra_sizes: dict[str, int] | None = None,
) -> BoundAnno:
    """Expand and size `anno` from the inputs; check the outputs it implies against the traced ones."""
    if not anno.inputs and in_shapes and all(s == () for s in in_shapes):
        # ' -> ' over 0-d tensors: an empty input list reads as one 0-d tensor per input
        anno = OpAnno(tuple(TensorAnno(()) for _ in in_shapes), anno.outputs)
    if len(anno.inputs) != len(in_shapes):
        raise AnnotationError(
            f"annotation '{anno}' has {len(anno.inputs)} inputs, the op has {len(in_shapes)} tensors"
        )
    if len(anno.outputs) != len(out_shapes):
        raise AnnotationError(
            f"annotation '{anno}' has {len(anno.outputs)} outputs, the op has {len(out_shapes)}"
        )
    star: int | None = None
    inputs, outputs = [], []
    for t, s in zip(anno.inputs, in_shapes):
        t2, star = _expand_star(t, None if s is None else len(s), star)
        inputs.append(t2)
    for t, s in zip(anno.outputs, out_shapes):
        t2, star = _expand_star(t, None if s is None else len(s), star)
        outputs.append(t2)
    sizes: dict[str, int] = dict(extra_sizes or {})
    for i, (t, s) in enumerate(zip(inputs, in_shapes)):
        if s is not None:
            _learn(t, s, sizes, f"input {i}")
    for i, (t, s) in enumerate(zip(outputs, out_shapes)):
        inferred = _infer(t, sizes)
        if inferred is not None and s is not None and inferred != tuple(s):
            raise AnnotationError(
                f"annotation '{anno}' infers output {i} shape {list(inferred)} but the traced shape is {list(s)}"
            )
        if s is not None:
            _learn(t, s, sizes, f"output {i}")
    return BoundAnno(OpAnno(tuple(inputs), tuple(outputs)), sizes)
