"""Sample arguments for every registered op (see test_op_fuzz.py): one maker per op, built from a few
family helpers (views, data movement and functional writes: op_fuzz_view_cases.py).

A maker takes a seeded `Draw` and returns the op's cases (positional args with the tensors in place,
kwargs): shapes consistent with the op's schema, sizes mostly 6 or 12 (2 and 3 ways divide them),
sometimes 2 or 3 (one element per device), index tensors in range, bool masks, positive inputs where
the op needs them. Inputs are float64 unless the op wants another dtype. Passing one tensor object
twice makes one value read twice (x @ x)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["Case", "Draw", "Maker", "COMPUTE_CASES", "binary", "unary", "cases"]

CPU = torch.device("cpu")
F32 = torch.float32


@dataclass(frozen=True)
class Case:
    """One call of an op. check: 'value' (equal to the whole op), 'meta' (shape and dtype only: the op
    returns uninitialised memory), 'dropout' (each element is 0 or the input / (1 - p))."""

    args: tuple
    kwargs: dict = field(default_factory=dict)
    check: str = "value"


class Draw:
    """Seeded sizes and values."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)

    def n(self) -> int:
        """A size: mostly 6 or 12 (2 and 3 ways divide it), sometimes 2 or 3 (one element per device)."""
        return self.rng.choice((6, 12, 6, 12, 2, 3))

    def big(self) -> int:
        """A size both 2 and 3 ways divide, for dims the case cuts further (reshapes, groups)."""
        return self.rng.choice((6, 12))

    def shape(self, rank: int) -> list[int]:
        return [self.n() for _ in range(rank)]

    def dim(self, rank: int) -> int:
        return self.rng.randrange(-rank, rank)

    def f(self, *shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen, dtype=dtype)

    def pos(self, *shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=self.gen, dtype=torch.float64) + 0.5

    def i(self, high: int, *shape: int, low: int = 0) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=self.gen)

    def b(self, *shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=self.gen) < 0.5

    def perm(self, n: int) -> torch.Tensor:
        return torch.randperm(n, generator=self.gen)


Maker = Callable[[Draw], list[Case]]

# value makers: (draw, *shape) -> tensor
FLT = Draw.f
POS = Draw.pos
BOOL = Draw.b


def INT(d: Draw, *shape: int) -> torch.Tensor:
    return d.i(10, *shape, low=1)


def _pairs(d: Draw, mx, my, inplace: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two operands that broadcast: same shape, both broadcast, a smaller second one, a 0-d one."""
    a, b, c = d.shape(3)
    out = [(mx(d, a, b, c), my(d, a, b, c))]
    if not inplace:
        out.append((mx(d, a, 1, c), my(d, b, c)))
    out += [(mx(d, a, b, c), my(d, b, 1)), (mx(d, a, b, c), my(d))]
    return out


def binary(mx=FLT, my=FLT, extra: tuple = (), inplace: bool = False, **kwargs) -> Maker:
    return lambda d: [Case((x, y, *extra), kwargs) for x, y in _pairs(d, mx, my, inplace)]


def unary(mx=FLT, extra: tuple = (), check: str = "value", **kwargs) -> Maker:
    return lambda d: [Case((mx(d, *d.shape(3)), *extra), kwargs, check)]


def cases(fn: Callable[[Draw], list[tuple]]) -> Maker:
    """A maker from a function returning argument tuples (or Cases)."""
    return lambda d: [c if isinstance(c, Case) else Case(c) for c in fn(d)]


# ---- elementwise ------------------------------------------------------------------------------------


def _masked(value_of, inplace: bool = False) -> Maker:
    def make(d: Draw) -> list[tuple]:
        a, b, c = d.shape(3)
        out = [(d.f(a, b, c), d.b(a, b, c), value_of(d)), (d.f(a, b, c), d.b(b, 1), value_of(d))]
        if not inplace:
            out.append((d.f(a, 1, c), d.b(b, c), value_of(d)))  # the output is the broadcast shape
        return out

    return cases(make)


def _where(d: Draw) -> list[tuple]:
    a, b, c = d.shape(3)
    return [(d.b(a, b, c), d.f(a, b, c), d.f(a, b, c)), (d.b(a, 1, c), d.f(b, c), d.f(a, b, 1))]


def _clamp_tensor(d: Draw) -> list[tuple]:
    a, b, c = d.shape(3)
    return [(d.f(a, b, c), -d.pos(b, c), d.pos(c)), (d.f(a, b, c), None, d.pos(a, b, c))]


def _like_other(d: Draw) -> list[tuple]:
    """to.other / type_as: `other` gives only the dtype, whatever its shape."""
    a, b, c = d.shape(3)
    return [(d.f(a, b, c), d.f(a, b, c, dtype=F32)), (d.f(a, b, c), d.f(5, dtype=F32))]


def _dropout(d: Draw) -> list[Case]:
    x = d.f(d.big(), d.big(), d.n())  # enough elements for the kept fraction to be near 1 - p
    return [Case((x, 0.5, False)), Case((x, 0.5, True), check="dropout")]


ELEMENTWISE: dict[str, Maker] = {
    "add.Tensor": binary(alpha=2),
    "sub.Tensor": binary(),
    "mul.Tensor": binary(),
    "div.Tensor": binary(FLT, POS),
    "div.Tensor_mode": binary(FLT, POS, rounding_mode="floor"),
    "add.Scalar": unary(extra=(1.5,)),
    "sub.Scalar": unary(extra=(1.5,)),
    "mul.Scalar": unary(extra=(2.0,)),
    "div.Scalar": unary(extra=(2.0,)),
    "rsub.Scalar": unary(extra=(1.0,)),
    "rsub.Tensor": binary(),
    "pow.Tensor_Scalar": unary(extra=(3,)),
    "pow.Tensor_Tensor": binary(POS, FLT),
    "pow.Scalar": cases(lambda d: [(2.0, d.f(*d.shape(3)))]),
    "clamp.Tensor": cases(_clamp_tensor),
    "minimum.default": binary(),
    "maximum.default": binary(),
    "where.self": cases(_where),
    "where.ScalarOther": cases(lambda d: [(c, x, 0.0) for c, x in _pairs(d, BOOL, FLT)[:3]]),
    "where.ScalarSelf": cases(lambda d: [(c, 0.0, x) for c, x in _pairs(d, BOOL, FLT)[:3]]),
    "__and__.Tensor": binary(BOOL, BOOL),
    "__or__.Tensor": binary(BOOL, BOOL),
    "bitwise_and.Tensor": binary(INT, INT),
    "bitwise_or.Tensor": binary(INT, INT),
    "bitwise_not.default": unary(INT),
    "logical_and.default": binary(BOOL, BOOL),
    "logical_or.default": binary(BOOL, FLT),
    "logical_not.default": unary(BOOL),
    "masked_fill.Scalar": _masked(lambda d: 0.5),
    "masked_fill.Tensor": _masked(lambda d: d.f()),
    "masked_fill_.Scalar": _masked(lambda d: 0.5, inplace=True),
    "to.dtype": unary(extra=(F32,)),
    "to.dtype_layout": unary(dtype=F32, layout=torch.strided, device=CPU),
    "to.device": unary(extra=(CPU, F32)),
    "to.other": cases(_like_other),
    "_to_copy.default": unary(dtype=F32),
    "type_as.default": cases(_like_other),
    "full_like.default": unary(extra=(3.0,)),
    "empty_like.default": unary(check="meta"),
    "floor_divide.default": binary(FLT, POS),
    "remainder.Scalar": unary(extra=(0.7,)),
    "remainder.Tensor": binary(FLT, POS),
    "fmod.Scalar": unary(extra=(0.7,)),
    "lerp.Scalar": binary(extra=(0.3,)),
    "dropout.default": _dropout,
    "add_.Tensor": binary(inplace=True),
    "sub_.Tensor": binary(inplace=True),
    "mul_.Tensor": binary(inplace=True),
    "div_.Tensor": binary(FLT, POS, inplace=True),
    "add_.Scalar": unary(extra=(1.5,)),
    "mul_.Scalar": unary(extra=(2.0,)),
    "fill_.Scalar": unary(extra=(2.0,)),
    "clamp_.default": unary(extra=(-0.5, 0.5)),
    "gelu.default": unary(approximate="tanh"),
    "softplus.default": unary(extra=(2.0, 20.0)),
    "leaky_relu.default": unary(extra=(0.1,)),
    "hardtanh.default": unary(extra=(-0.5, 0.5)),
    "clamp.default": unary(extra=(-0.5, 0.5)),
    "clamp_min.default": unary(extra=(0.0,)),
    "clamp_max.default": unary(extra=(0.0,)),
}
for _cmp in ("eq", "ne", "lt", "le", "gt", "ge"):
    ELEMENTWISE[f"{_cmp}.Tensor"] = binary()
    ELEMENTWISE[f"{_cmp}.Scalar"] = unary(extra=(0.0,))
for _name in ["rsqrt", "sqrt", "log", "reciprocal", "log1p"]:
    ELEMENTWISE[f"{_name}.default"] = unary(POS)
_PLAIN = """exp neg abs sin cos tanh sigmoid silu relu erf contiguous clone alias detach lift_fresh_copy
zeros_like ones_like isnan isinf sign floor ceil round expm1 square gelu_ relu_ silu_"""
for _name in _PLAIN.split():
    ELEMENTWISE[f"{_name}.default"] = unary()


def _along_dim(extra: tuple = ()) -> Maker:
    return lambda d: [Case((d.f(*d.shape(3)), dim, *extra)) for dim in (-1, d.dim(3))]


ELEMENTWISE.update(
    {
        "softmax.int": _along_dim(),
        "_softmax.default": _along_dim((False,)),
        "log_softmax.int": _along_dim(),
        "_log_softmax.default": _along_dim((False,)),
        "cumsum.default": _along_dim(),
        "cumprod.default": _along_dim(),
        "triu.default": cases(lambda d: [(d.f(*d.shape(3)), 1)]),
        "tril.default": cases(lambda d: [(d.f(*d.shape(3)), -1)]),
        "broadcast_tensors.default": cases(lambda d: [([x, y],) for x, y in _pairs(d, FLT, FLT)]),
    }
)

# ---- linear, reduce, norm, conv -----------------------------------------------------------------------


def _twice(x: torch.Tensor) -> tuple:
    """One value read as both operands (x @ x): the partition needs it in two layouts."""
    return (x, x)


def _linear(d: Draw) -> list[tuple]:
    a, b, k, n = d.shape(4)
    return [(d.f(a, b, k), d.f(n, k), d.f(n)), (d.f(a, k), d.f(n, k)), _twice(d.f(6, 6))]


def _addmm(d: Draw) -> list[Case]:
    m, k, n = d.shape(3)
    x, w = d.f(m, k), d.f(k, n)
    return [
        Case((d.f(n), x, w)),
        Case((d.f(m, n), x, w)),  # a full-shaped bias
        Case((d.f(n), x, w), {"beta": 0.5, "alpha": 2.0}),
    ]


def _matmul(d: Draw) -> list[tuple]:
    a, b, m, k, n = d.shape(5)
    return [
        (d.f(k), d.f(k)),
        (d.f(a, b, k), d.f(k)),
        (d.f(k), d.f(a, k, n)),
        (d.f(k), d.f(k, n)),
        (d.f(a, m, k), d.f(k, n)),
        (d.f(a, 1, m, k), d.f(b, k, n)),
        (d.f(m, k), d.f(a, k, n)),  # 2-D @ batched: the batch comes from the second operand
        (d.f(a, m, k), d.f(a, k, n)),  # batched @ batched, same batch
        (d.f(a, b, m, k), d.f(1, k, n)),  # a size-1 batch broadcasts
        _twice(d.f(6, 6)),
    ]


def _baddbmm(d: Draw) -> list[Case]:
    """ALiBi's scores: a bias broadcast over the batch, scaled products; beta != 1 keeps k whole."""
    b, m, k, n = d.shape(4)
    x, y = d.f(b, m, k), d.f(b, k, n)
    return [
        Case((d.f(b, m, n), x, y)),
        Case((d.f(b, 1, n), x, y), {"beta": 1.0, "alpha": 0.25}),
        Case((d.f(n), x, y), {"beta": 0.5, "alpha": 2.0}),
        Case((d.f(b, m, n), x, y), {"beta": 0.0}),
    ]


def _addbmm(d: Draw) -> list[Case]:
    b, m, k, n = d.shape(4)
    x, y = d.f(b, m, k), d.f(b, k, n)
    return [
        Case((d.f(m, n), x, y)),
        Case((d.f(n), x, y), {"alpha": 0.5}),
        Case((d.f(m, 1), x, y), {"beta": 2.0, "alpha": 0.5}),
    ]


def _inner(d: Draw) -> list[tuple]:
    a, b, k = d.shape(3)
    return [(d.f(a, b, k), d.f(d.n(), k)), (d.f(k), d.f(k)), (d.f(), d.f(a, b))]


def _tensordot(d: Draw) -> list[tuple]:
    a, b, c, e = d.shape(4)
    return [(d.f(a, b, c), d.f(c, b, e), [1, 2], [1, 0]), (d.f(a, b), d.f(b, c), [1], [0])]


def _vecdot(d: Draw) -> list[Case]:
    a, b, c = d.shape(3)
    return [Case((d.f(a, b, c), d.f(b, c))), Case((d.f(a, b, c), d.f(a, 1, c)), {"dim": 1})]


def _multi_dot(d: Draw) -> list[tuple]:
    a, b, c, e = d.shape(4)
    return [([d.f(a, b), d.f(b, c), d.f(c, e)],), ([d.f(b), d.f(b, c), d.f(c)],), ([d.f(a, b), d.f(b)],)]


def _einsum(d: Draw) -> list[tuple]:
    """One case per equation shape."""
    b, h, s, t, e, f = d.shape(6)
    return [
        ("ij,jk->ik", [d.f(s, e), d.f(e, f)]),  # matmul
        ("bij,bjk->bik", [d.f(b, s, e), d.f(b, e, f)]),  # batched
        ("bhqd,bhkd->bhqk", [d.f(b, h, s, e), d.f(b, h, t, e)]),  # attention scores
        ("bhqk,bhkd->bhqd", [d.f(b, h, s, t), d.f(b, h, t, e)]),  # attention values
        ("bsd,fd->bsf", [d.f(b, s, e), d.f(f, e)]),  # a projection on a weight
        ("i,j->ij", [d.f(s), d.f(t)]),  # outer product
        ("ii->", [d.f(s, s)]),  # trace
        ("bii->bi", [d.f(b, s, s)]),  # batched diagonal
        ("...ij,...jk->...ik", [d.f(b, h, s, e), d.f(h, e, f)]),  # ellipsis, broadcast batch
        ("...d,...d->...", [d.f(b, 1, e), d.f(s, e)]),  # size-1 ellipsis dim broadcasts
        ("bi,ij,jk->bk", [d.f(b, s), d.f(s, e), d.f(e, f)]),  # three operands
        ("ij,jk", [d.f(s, e), d.f(e, f)]),  # implicit output
        ("bsd,dB->Bs", [d.f(b, s, e), d.f(e, f)]),  # summed batch, capital letters
        ("bsd,bd->bs", [d.f(b, s, e), d.f(1, e)]),  # a size-1 letter broadcasts
    ]


LINEAR: dict[str, Maker] = {
    "linear.default": cases(_linear),
    "addmm.default": _addmm,
    "mm.default": cases(lambda d: [(d.f(d.n(), 6), d.f(6, d.n())), _twice(d.f(6, 6))]),
    "bmm.default": cases(lambda d: [(d.f(6, d.n(), 12), d.f(6, 12, d.n())), _twice(d.f(6, 6, 6))]),
    "matmul.default": cases(_matmul),
    "baddbmm.default": _baddbmm,
    "addbmm.default": _addbmm,
    "einsum.default": cases(_einsum),
    "mv.default": cases(lambda d: [(d.f(d.n(), 6), d.f(6))]),
    "dot.default": cases(lambda d: [(d.f(6), d.f(6))]),
    "vdot.default": cases(lambda d: [(d.f(12), d.f(12))]),
    "outer.default": cases(lambda d: [(d.f(d.n()), d.f(d.n()))]),
    "ger.default": cases(lambda d: [(d.f(d.n()), d.f(d.n()))]),
    "inner.default": cases(_inner),
    "tensordot.default": cases(_tensordot),
    "linalg_vecdot.default": _vecdot,
    "linalg_multi_dot.default": cases(_multi_dot),
    "chain_matmul.default": cases(lambda d: [([d.f(d.n(), 6), d.f(6, 12), d.f(12, d.n())],)]),
}


def _reduce(mx=FLT, dims: Callable[[Draw], list] | None = None, **kwargs) -> Maker:
    def make(d: Draw) -> list[Case]:
        x = mx(d, *d.shape(3))
        variants = dims(d) if dims else [()]
        return [Case((x, *v), kwargs) for v in variants]

    return make


def _dim_lists(d: Draw) -> list[tuple]:
    return [([d.dim(3)], True), ([0, -1],), (None,)]


REDUCE: dict[str, Maker] = {
    "sum.dim_IntList": _reduce(dims=_dim_lists),
    "sum.default": _reduce(),
    "mean.dim": _reduce(dims=_dim_lists),
    "mean.default": _reduce(),
    "amax.default": _reduce(dims=lambda d: [([d.dim(3)], True), ([],)]),
    "amin.default": _reduce(dims=lambda d: [([0, 2],)]),
    "var.correction": _reduce(dims=lambda d: [([d.dim(3)],)], correction=1, keepdim=True),
    "std.correction": _reduce(dims=lambda d: [([1, 2],)], correction=0),
    "any.dim": _reduce(BOOL, dims=lambda d: [(d.dim(3), True)]),
    "all.dim": _reduce(BOOL, dims=lambda d: [(d.dim(3),)]),
    "argmax.default": _reduce(dims=lambda d: [(d.dim(3), True), ()]),
    "argmin.default": _reduce(dims=lambda d: [(d.dim(3),)]),
    "prod.dim_int": _reduce(dims=lambda d: [(d.dim(3),)]),
}


def _layer_norm(d: Draw) -> list[tuple]:
    a, b, c = d.shape(3)
    x = d.f(a, b, c)
    return [(x, [c], d.f(c), d.f(c), 1e-5), (x, [b, c])]


def _rms_norm(d: Draw) -> list[tuple]:
    a, b, c = d.shape(3)
    x = d.f(a, b, c)
    return [(x, [c], d.f(c), 1e-6), (x, [b, c])]


def _batch_norm(d: Draw) -> list[tuple]:
    n, c = d.shape(2)

    def stats():
        return d.f(c), d.f(c), d.f(c), d.pos(c)

    return [
        (d.f(n, c, 5), *stats(), True, 0.1, 1e-5, False),
        (d.f(n, c, 3, 4), *stats(), False, 0.1, 1e-5, False),
        (d.f(n, c), None, None, d.f(c), d.pos(c), False, 0.1, 1e-5, False),
    ]


NORM: dict[str, Maker] = {
    "layer_norm.default": cases(_layer_norm),
    "rms_norm.default": cases(_rms_norm),
    "batch_norm.default": cases(_batch_norm),
    "instance_norm.default": cases(
        lambda d: [(d.f(6, 12, 5), d.f(12), d.f(12), None, None, True, 0.1, 1e-5, False)]
    ),
    "group_norm.default": cases(
        lambda d: [
            (d.f(d.n(), 12, 5), 3, d.f(12), d.f(12), 1e-5, False),
            (d.f(d.n(), 12, 2, 3), 6, d.f(12), d.f(12), 1e-5, False),  # 2 and 3 ways split the groups
            (d.f(d.n(), 6, 4), 1, None, None, 1e-5, False),
        ]
    ),
}


def _conv(nsp: int, kind: str = "conv") -> Maker:
    """conv{n}d (kind 'conv'), conv{n}d.padding ('same'), conv_transpose{n}d ('transpose') or
    aten.convolution ('convolution', both directions). With a bias, a split on the input channels runs
    the conv without it, all-reduces, then adds bias.view(-1, 1, ..) once (grouped: within groups)."""

    def make(d: Draw) -> list[tuple]:
        n, c, o = d.n(), d.big(), d.big()
        sp, ks, ones = [5 if nsp < 3 else 3] * nsp, [3] * nsp, [1] * nsp  # fp64 conv3d is slow: keep it tiny
        pad = "same" if kind == "same" else ones
        x, unbatched = d.f(n, c, *sp), d.f(c, *sp)
        variants = [(1, True, x), (1, False, x), (6, False, x)]
        if nsp < 3 and kind != "convolution":
            variants += [(2, True, x), (1, False, unbatched), (1, True, unbatched)]
        out = []
        for groups, bias, inp in variants:
            for transposed in {"conv": [False], "same": [False], "transpose": [True]}.get(
                kind, [False, True]
            ):
                w = d.f(c, o // groups, *ks) if transposed else d.f(o, c // groups, *ks)
                b = d.f(o) if bias else None
                if kind == "convolution":
                    out.append((inp, w, b, ones, ones, ones, transposed, [0] * nsp, groups))
                elif transposed:
                    out.append((inp, w, b, ones, ones, [0] * nsp, groups, ones))
                else:
                    out.append((inp, w, b, ones, pad, ones, groups))
        return out

    return cases(make)


def _pool(nsp: int, *extra: list) -> Maker:
    return cases(lambda d: [(d.f(*d.shape(2), *[4] * nsp), *extra), (d.f(d.n(), *[4] * nsp), *extra)])


def _upsample(nsp: int, *extra) -> Maker:
    """(batch, channels, spatial..): resampling has no unbatched form."""
    return cases(lambda d: [(d.f(*d.shape(2), *[4] * nsp), *extra)])


CONV: dict[str, Maker] = {
    **{f"conv{k}d.default": _conv(k) for k in (1, 2, 3)},
    **{f"conv{k}d.padding": _conv(k, "same") for k in (1, 2, 3)},
    "conv_transpose1d.default": _conv(1, "transpose"),
    "conv_transpose2d.input": _conv(2, "transpose"),
    "conv_transpose3d.input": _conv(3, "transpose"),
    "convolution.default": _conv(2, "convolution"),
    **{f"max_pool{k}d.default": _pool(k, [2] * k, [2] * k) for k in (1, 2, 3)},
    **{f"avg_pool{k}d.default": _pool(k, [2] * k, [1] * k) for k in (1, 2, 3)},
    **{f"adaptive_avg_pool{k}d.default": _pool(k, [3] * k) for k in (1, 2, 3)},
    "adaptive_max_pool2d.default": _pool(2, [3, 2]),
    **{f"upsample_nearest{k}d.vec": _upsample(k, None, [2.0] * k) for k in (1, 2, 3)},
    "upsample_linear1d.vec": _upsample(1, None, False, [2.0]),
    "upsample_bilinear2d.vec": _upsample(2, None, True, [2.0, 1.5]),
    "upsample_bicubic2d.vec": _upsample(2, None, False, [2.0, 2.0]),
    "upsample_trilinear3d.vec": _upsample(3, None, False, [2.0] * 3),
}

# ---- creation, embedding, loss, moe, attention --------------------------------------------------------


def _creation(fn: Callable[[Draw, list[int]], tuple], check: str = "value", **kwargs) -> Maker:
    return lambda d: [Case(fn(d, d.shape(2)), kwargs, check)]


CREATION: dict[str, Maker] = {
    "arange.default": _creation(lambda d, s: (s[0],), device=CPU, pin_memory=False),
    "arange.start": _creation(lambda d, s: (2, s[0] + 2), dtype=torch.float64),
    "arange.start_step": _creation(lambda d, s: (0, s[0], 2)),
    "zeros.default": _creation(lambda d, s: (s,), dtype=torch.float64),
    "ones.default": _creation(lambda d, s: (s,)),
    "full.default": _creation(lambda d, s: (s, 1.5)),
    "empty.memory_format": _creation(lambda d, s: (s,), check="meta"),
    "new_ones.default": _creation(lambda d, s: (d.f(3), s)),
    "new_zeros.default": _creation(lambda d, s: (d.f(3), s)),
    "new_full.default": _creation(lambda d, s: (d.f(3), s, 2.5)),
    "new_empty.default": _creation(lambda d, s: (d.f(3), s), check="meta"),
    "scalar_tensor.default": _creation(lambda d, s: (2.5,)),
    # replicated on every rank, drawn from the same seed: equal to the whole op (test_op_fuzz reseeds)
    "rand.default": _creation(lambda d, s: (s,), dtype=torch.float64),
    "randn.default": _creation(lambda d, s: (s,), dtype=torch.float64),
    "linspace.default": _creation(lambda d, s: (0.0, 1.0, s[0])),
}


def _embedding(d: Draw) -> list[tuple]:
    v, h, a, b = d.big(), d.n(), d.n(), d.n()
    w = d.f(v, h)
    return [(w, d.i(v, a, b)), (w, d.i(v, a), 2)]


def _targets(d: Draw, c: int, *shape: int) -> torch.Tensor:
    t = d.i(c, *shape)
    return t.masked_fill(d.i(4, *shape) == 0, -100)  # about a quarter ignored


def _cross_entropy(d: Draw) -> list[tuple]:
    # float32: the vocab-parallel helper computes in float32 whatever the logits' dtype
    n, c = d.n(), d.big()
    x, t = d.f(n, c, dtype=F32), _targets(d, c, n)
    return [
        (x, t),
        (x, t, None, 2),
        (x, t, None, 0),
        (x, t.masked_fill(t < 0, 3), None, 1, 3),  # ignore_index 3
        (x, t, d.pos(c).float(), 1),  # weighted: replicate only
        (x, t, None, 1, -100, 0.1),  # label smoothing: replicate only
        (d.f(n, c, 4, dtype=F32), _targets(d, c, n, 4)),  # class dim 1 of 3: replicate only
    ]


def _mse(d: Draw) -> list[tuple]:
    s = d.shape(3)
    x, y = d.f(*s), d.f(*s)
    return [(x, y), (x, y, 0), (x, y, 2)]


def _grouped_mm(dtype: torch.dtype, k: int, fallback: bool = False) -> Maker:
    """Tokens sorted by expert (`offs`: cumulative counts). CPU aten._grouped_mm wants float32 rows of
    16-byte multiples: k and n, and their local parts, multiples of 4."""

    def make(d: Draw) -> list[tuple]:
        if fallback:  # registers torch.ops.transformers.grouped_mm_fallback (a slow import: only here)
            import transformers.integrations.moe  # noqa: F401

        t, e = 12, 3
        counts = torch.tensor([0, *sorted(d.rng.sample(range(1, t), e - 1)), t])
        offs = counts[1:].to(torch.int32)
        return [(d.f(t, k, dtype=dtype), d.f(e, k, k, dtype=dtype), offs)]

    return cases(make)


def _sdpa(d: Draw) -> list[Case]:
    b, h = d.shape(2)
    s, t, e = 4, 5, 8

    def qkv(hq, hk, lead=(b,)):
        return d.f(*lead, hq, s, e), d.f(*lead, hk, t, e), d.f(*lead, hk, t, e + 2)

    return [
        Case(qkv(h, h)),
        Case((*qkv(h, h), None, 0.0, False), {"scale": 0.3}),
        Case((*qkv(h, h), d.b(b, 1, s, t) | torch.eye(s, t, dtype=torch.bool))),
        Case((*qkv(h, h), d.f(s, t))),
        Case((*qkv(h, h), d.f(b, h, s, t))),
        Case((*qkv(h, h, (b, 3)), d.f(3, 1, s, t))),  # two batch dims
        Case(qkv(h, h, ())),  # no batch dim
        Case(qkv(2 * h, h), {"enable_gqa": True}),
        Case((*qkv(2 * h, h), d.f(b, 2 * h, s, t)), {"enable_gqa": True}),  # a mask per query head
        Case(qkv(h, 1)),  # multi-query: one key/value head broadcast to every query head
        Case((*qkv(h, 1), d.b(b, 1, s, t) | torch.eye(s, t, dtype=torch.bool)), {"enable_gqa": True}),
        # dropout_p > 0 is not run: split by heads it draws under the shard generator (shard_rng),
        # which needs a real process group
    ]


OTHER: dict[str, Maker] = {
    "embedding.default": cases(_embedding),
    "cross_entropy_loss.default": cases(_cross_entropy),
    "mse_loss.default": cases(_mse),
    "_grouped_mm.default": _grouped_mm(F32, 24),
    "scaled_dot_product_attention.default": _sdpa,
}

COMPUTE_CASES: dict[str, Maker] = {
    "aten." + op: maker
    for table in (ELEMENTWISE, LINEAR, REDUCE, NORM, CONV, CREATION, OTHER)
    for op, maker in table.items()
}
COMPUTE_CASES["transformers.grouped_mm_fallback.default"] = _grouped_mm(torch.float64, 12, fallback=True)


def _chunk_linear_ce(d: Draw) -> list[tuple]:
    """nnscaler.runtime.chunked_loss: chunks smaller than the tokens, and one chunk for all of them."""
    n, k, v = d.n(), d.n(), d.big()
    h, w, t = d.f(n, k), d.f(v, k), _targets(d, v, n)
    return [(h, w, t, -100, 4), (h, w, t.masked_fill(t < 0, 3), 3, n)]


COMPUTE_CASES["nnscaler.chunk_linear_cross_entropy.default"] = cases(_chunk_linear_ce)


def _moe_experts(d: Draw) -> list[tuple]:
    """nnscaler.runtime.moe: tokens routed top-2 over 4 experts (uneven counts), silu-gated experts."""
    import nnscaler.runtime.moe  # noqa: F401  (registers torch.ops.nnscaler.moe_experts)

    t, h, i, e, k = 8, 4, 4, 4, 2
    index = torch.stack([torch.tensor(d.rng.sample(range(e), k)) for _ in range(t)])
    weights = d.f(t, k).softmax(-1)
    return [(d.f(t, h), index, weights, d.f(e, 2 * i, h), d.f(e, h, i), "silu")]


COMPUTE_CASES["nnscaler.moe_experts.default"] = cases(_moe_experts)
