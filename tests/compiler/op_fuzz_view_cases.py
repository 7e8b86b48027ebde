"""Sample arguments for views, data movement and functional writes (see op_fuzz_cases.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tests.compiler.op_fuzz_cases import Case, Draw, Maker, binary, cases, unary

__all__ = ["VIEW_CASES"]

INT_MAX = 9223372036854775807


def _reshapes(d: Draw) -> list[tuple[torch.Tensor, list[int]]]:
    a, b, c = d.big(), d.big(), d.n()
    x = d.f(a, b, c)
    return [
        (x, [a, 3, b // 3, c]),  # split a dim: (c d)
        (x, [a * b, c]),  # merge two
        (x, [a, -1]),
        (x, [2, a // 2, b, c]),
        (x, [a, 1, b, c]),
        (d.f(a, 1, b), [a, b]),
        (d.f(a, 4, 3), [a, 3, 4]),  # many-to-many: kept whole
        (d.f(a, b), [-1]),
    ]


def _view_like(op: str) -> Maker:
    if op.endswith("_as.default"):  # the target shape comes from a second tensor
        return cases(lambda d: [(x, d.f(*x.reshape(shape).shape)) for x, shape in _reshapes(d)])
    return cases(_reshapes)


def _expand(d: Draw) -> list[tuple]:
    a, b, c = d.shape(3)
    return [(d.f(a, 1, c), [a, b, c]), (d.f(c), [a, c]), (d.f(a, 1, c), [-1, b, -1]), (d.f(1, c), [a, b, c])]


def _split(op: str) -> Maker:
    def make(d: Draw) -> list[tuple]:
        a, b = d.big(), d.big()
        x = d.f(a, b, 12)
        if op == "split.Tensor":
            return [(x, 4, 2), (x, b // 3, 1), (x, 5, -1)]
        if op == "chunk.default":
            return [(x, 3, -1), (x, 2, 0), (x, 5, 2)]
        if op == "split_with_sizes.default":
            return [(x, [4, 4, 4], 2), (x, [2, 10], -1), (x, [b // 2, b // 2], 1)]
        if op == "tensor_split.sections":
            return [(x, 3, 2), (x, 5, -1), (x, 2, 0)]
        if op == "tensor_split.indices":
            return [(x, [2, 5], 2), (x, [4, 8], -1), (x, [a // 2], 0)]
        return [(x, 1), (x, -1)]

    return cases(make)


def _cat(stack: bool) -> Maker:
    def make(d: Draw) -> list[tuple]:
        a, b, c = d.shape(3)
        if stack:
            return [([d.f(a, b), d.f(a, b)], 1), ([d.f(a, b), d.f(a, b), d.f(a, b)], 0)]
        return [([d.f(a, b, c), d.f(a, 6, c)], 1), ([d.f(a, b, c), d.f(a, b, 6), d.f(a, b, c)], -1)]

    return cases(make)


def _x3(fn: Callable[[Draw, torch.Tensor], list[tuple]]) -> Maker:
    return cases(lambda d: fn(d, d.f(d.big(), d.big(), d.big())))


def _scatter(value=None, **kwargs) -> Maker:
    """scatter along dim 1: an index spanning the other dims, then one shorter in dim 0 (value: a
    number instead of a src tensor)."""

    def make(d: Draw) -> list[Case]:
        x = d.f(*d.shape(3))
        a, b, c = x.shape
        out = []
        for rows in (a, 2):
            src = (value,) if value is not None else (d.f(rows, 4, c),)
            out.append(Case((x, 1, d.i(b, rows, 4, c), *src), kwargs))
        return out

    return make


def _index_add_like(d: Draw, x: torch.Tensor) -> list[tuple]:
    a, b, c = x.shape
    return [(x, 1, d.perm(b)[:4], d.f(a, 4, c))]


def _index_put(d: Draw, x: torch.Tensor) -> list[tuple]:
    a, b, c = x.shape
    rows, cols = d.perm(a)[:3], d.perm(c)[:3]
    return [
        (x, [rows], d.f(3, b, c), False),
        (x, [rows], d.f(1, c), False),  # values broadcast
        (x, [None, d.i(b, 5)], d.f(a, 5, c), True),
        (x, [d.b(a, b)], d.f(c), False),  # a mask over two dims
        (x, [rows, None, cols], d.f(3, b), False),  # index tensors apart: their dim goes first
        (x, [None, None, d.i(c, 2, 2)], d.f(a, b, 2, 2), True),
    ]


def _slice_scatter(d: Draw, x: torch.Tensor) -> list[tuple]:
    a, b, c = x.shape
    return [
        (x, d.f(a, 3, c), 1, 2, 5),
        (x, d.f(a, b, c // 2), -1, 0, INT_MAX, 2),
        (x, d.f(a, b, c), 0, 0, INT_MAX),  # the whole dim: the result is src
        (x, d.f(a, b, c), 1, None, None),
    ]


_VIEW: dict[str, Maker] = {
    **{op: _view_like(op) for op in ["view.default", "reshape.default", "_unsafe_view.default"]},
    **{op: _view_like(op) for op in ["view_as.default", "reshape_as.default"]},
    "flatten.using_ints": _x3(lambda d, x: [(x, 1, 2), (x, 0, -1), (x, 0, 1)]),
    "unflatten.int": _x3(lambda d, x: [(x, 1, [3, x.shape[1] // 3]), (x, -1, [2, -1])]),
    # squeezes of dims larger than 1 (no-ops), some of 2 or 3 elements: one per device when split
    "squeeze.dim": cases(lambda d: [(d.f(d.n(), 1, d.n()), 1), (d.f(2, d.n()), 0), (d.f(d.n(), 3), -1)]),
    "squeeze.dims": cases(lambda d: [(d.f(d.n(), 1, d.n(), 1), [1, -1]), (d.f(3, 1, 2), [0, 1, 2])]),
    "squeeze.default": cases(lambda d: [(d.f(d.n(), 1, d.n()),), (d.f(2, 1, 3),)]),
    "unsqueeze.default": _x3(lambda d, x: [(x, 1), (x, -1)]),
    "expand.default": cases(_expand),
    "expand_as.default": cases(lambda d: [(x, d.f(*x.expand(shape).shape)) for x, shape in _expand(d)]),
    "transpose.int": _x3(lambda d, x: [(x, 0, 2), (x, -1, -2)]),
    "permute.default": _x3(lambda d, x: [(x, [2, 0, 1])]),
    "t.default": cases(lambda d: [(d.f(*d.shape(2)),), (d.f(d.n()),)]),
    "movedim.int": _x3(lambda d, x: [(x, 0, -1)]),
    "swapaxes.default": _x3(lambda d, x: [(x, 0, 2), (x, -1, -2)]),
    "swapdims.default": _x3(lambda d, x: [(x, 1, 0)]),
    "numpy_T.default": cases(lambda d: [(d.f(*d.shape(2)),), (d.f(*d.shape(3)),), (d.f(d.n()),)]),
    **{op: _x3(lambda d, x: [(x,)]) for op in ["mT.default", "mH.default", "adjoint.default"]},
    "matrix_H.default": cases(lambda d: [(d.f(*d.shape(2)),)]),  # x.H: 2-D only
    **{op: _split(op) for op in ["split.Tensor", "chunk.default", "split_with_sizes.default", "unbind.int"]},
    **{op: _split(op) for op in ["tensor_split.sections", "tensor_split.indices"]},
    "slice.Tensor": _x3(lambda d, x: [(x, 1, 2, 5), (x, 0, 0, INT_MAX), (x, -1, 0, INT_MAX, 2)]),
    "narrow.default": _x3(lambda d, x: [(x, 1, 1, 3)]),
    "select.int": _x3(lambda d, x: [(x, 1, 2), (x, -1, 0)]),
    "cat.default": _cat(False),
    "stack.default": _cat(True),
    "index.Tensor": _x3(
        lambda d, x: [(x, [d.i(x.shape[0], 4)]), (x, [None, d.i(x.shape[1], 2, 3)]), (x, [d.b(*x.shape[:2])])]
    ),
    "gather.default": _x3(lambda d, x: [(x, 1, d.i(x.shape[1], x.shape[0], 4, x.shape[2]))]),
    "index_select.default": _x3(lambda d, x: [(x, -1, d.i(x.shape[2], 5))]),
    "diff.default": _x3(lambda d, x: [(x, 1, 1)]),
    "pad.default": _x3(
        lambda d, x: [
            (x, [1, 2], "constant", 0.5),
            (x, [1, 1, 0, 0], "reflect"),
            (x, [0, 0, 2, 1, 1, 0], "constant", 0.0),
        ]
    ),
    "constant_pad_nd.default": _x3(lambda d, x: [(x, [1, 1, 2, 0], 0.0)]),
    "roll.default": _x3(lambda d, x: [(x, [1], [1]), (x, [2, -1], [0, 2]), (x, [3], [])]),
    "flip.default": _x3(lambda d, x: [(x, [0, 2])]),
    "repeat.default": _x3(lambda d, x: [(x, [2, 1, 1])]),
    "repeat_interleave.self_int": _x3(lambda d, x: [(x, 2, 1)]),
    "scatter.src": _scatter(),
    "scatter_add.default": _scatter(),
    "scatter.value": _scatter(1.5),
    "scatter.reduce": _scatter(reduce="multiply"),
    "scatter.value_reduce": _scatter(2.0, reduce="add"),
    "scatter_reduce.two": _scatter(reduce="amax", include_self=False),
    "slice_scatter.default": _x3(_slice_scatter),
    "select_scatter.default": _x3(
        lambda d, x: [(x, d.f(x.shape[0], x.shape[2]), 1, 2), (x, d.f(*x.shape[1:]), 0, -1)]
    ),
    "diagonal_scatter.default": _x3(
        lambda d, x: [(x, d.f(*x.diagonal(1, 0, 1).shape), 1), (x, d.f(*x.diagonal(0, 1, 2).shape), 0, 1, 2)]
    ),
    "as_strided_scatter.default": _x3(lambda d, x: [(x, d.f(2, 3), [2, 3], [x.shape[2], 2], 1)]),
    "copy.default": binary(inplace=True),
    "copy_.default": binary(inplace=True),
    "fill.Scalar": unary(extra=(2.0,)),
    "fill.Tensor": cases(lambda d: [(d.f(*d.shape(3)), d.f())]),
    "zero.default": unary(),
    "nonzero.default": _x3(lambda d, x: [(x.clamp(min=0),)]),
    "topk.default": _x3(lambda d, x: [(x, 3, -1)]),
    "sort.default": _x3(lambda d, x: [(x, 1)]),
    "argsort.default": _x3(lambda d, x: [(x, -1)]),
    "histc.default": _x3(lambda d, x: [(x, 6, -1.0, 1.0)]),
    "index_put.default": _x3(_index_put),
    "index_put_.default": _x3(_index_put),
    "bincount.default": cases(lambda d: [(d.i(7, 12), None, 0)]),
    "searchsorted.Tensor": cases(lambda d: [(d.f(6, 12).sort(-1).values, d.f(6, 5))]),
    "index_add.default": _x3(_index_add_like),
    "index_copy.default": _x3(_index_add_like),
    "masked_scatter.default": _x3(lambda d, x: [(x, d.b(*x.shape), d.f(*x.shape))]),
    "one_hot.default": cases(lambda d: [(d.i(6, d.n(), 5), 6)]),
}

VIEW_CASES: dict[str, Maker] = {"aten." + op: maker for op, maker in _VIEW.items()}
