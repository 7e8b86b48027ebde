"""Custom autograd Functions without an annotation are probed (issue 40): one whose forward and
backward are elementwise or row-wise gets the annotation of the dims it commutes with slicing along,
so it (and the MLP around it) splits; any other stays whole. Decided by running it, never by name.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nnscaler.graph.capture import capture
from nnscaler.graph.ir import Ref, TensorMeta
from nnscaler.graph.ops import annotate_node
from nnscaler.graph.ops.probe import probe_annotation


class TanhGelu(torch.autograd.Function):
    """GeLU (tanh approximation) written by hand: elementwise forward and backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x**3)))

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.7978845608 * (x + 0.044715 * x**3))
        return grad * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * 0.7978845608 * (1 + 3 * 0.044715 * x * x))


class RowNorm(torch.autograd.Function):
    """RMS norm with a weight: each row on its own (the last dim must stay whole)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    @staticmethod
    def backward(ctx, grad):
        with torch.enable_grad():
            x, w = (t.detach().requires_grad_() for t in ctx.saved_tensors)
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        return torch.autograd.grad(y, (x, w), grad)


class CumSum(torch.autograd.Function):
    """Mixes positions along dim 0 (a running sum): that dim must not split, the others may."""

    @staticmethod
    def forward(ctx, x):
        return x.cumsum(0)

    @staticmethod
    def backward(ctx, grad):
        return grad.flip(0).cumsum(0).flip(0)


class GlobalGrad(torch.autograd.Function):
    """Elementwise forward, but the backward scales by a mean over the whole tensor: not splittable."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * grad.mean()


class Noisy(torch.autograd.Function):
    """Draws random numbers: no split reproduces it."""

    @staticmethod
    def forward(ctx, x):
        return x + torch.randn_like(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class Reduces(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.sum(0)

    @staticmethod
    def backward(ctx, grad):
        return grad.expand(4, *grad.shape)


class Picky(torch.autograd.Function):
    """Elementwise, but refuses any other row length than the traced one."""

    @staticmethod
    def forward(ctx, x):
        assert x.shape[-1] == 6, "rows of 6"
        return x.sin()

    @staticmethod
    def backward(ctx, grad):
        return grad


class ScaledSwiGLU(torch.autograd.Function):
    """Two inputs, a gate broadcast over the rows and a float argument: elementwise."""

    @staticmethod
    def forward(ctx, x, gate, scale: float):
        ctx.save_for_backward(x, gate)
        ctx.scale = scale
        return F.silu(gate) * x * scale

    @staticmethod
    def backward(ctx, grad):
        x, gate = ctx.saved_tensors
        sig = torch.sigmoid(gate)
        dgate = grad * x * ctx.scale * sig * (1 + gate * (1 - sig))
        if gate.shape[0] == 1 and dgate.shape[0] != 1:
            dgate = dgate.sum(0, keepdim=True)  # the gate broadcast over the rows
        return grad * F.silu(gate) * ctx.scale, dgate, None


class SumOfList(torch.autograd.Function):
    """A list of tensors in: their elementwise sum."""

    @staticmethod
    def forward(ctx, xs):
        ctx.n = len(xs)
        return torch.stack(xs).sum(0)

    @staticmethod
    def backward(ctx, grad):
        return None


WIDE = 1000


class WideRows(torch.autograd.Function):
    """Elementwise, but written for rows of exactly WIDE (a feature size it relies on)."""

    @staticmethod
    def forward(ctx, x):
        if x.shape[-1] != WIDE:
            raise ValueError(f"rows of {WIDE} expected, got {x.shape[-1]}")
        return x.cos()

    @staticmethod
    def backward(ctx, grad):
        return grad


class EightWideRows(torch.autograd.Function):
    """Elementwise, but written for 8 rows (the traced batch) and refusing 8 x 8 blocks."""

    @staticmethod
    def forward(ctx, x):
        if x.shape[0] != 8 or x.shape[-1] == 8:
            raise ValueError(f"8 rows, not of 8, expected, got {tuple(x.shape)}")
        return x.cos()

    @staticmethod
    def backward(ctx, grad):
        return grad


def _probe(fn: type, *shapes: tuple[int, ...], out: tuple[int, ...] | None = None) -> str | None:
    metas = [TensorMeta(s, "float32", True) for s in shapes]
    args = tuple(Ref(f"in{i}") for i in range(len(shapes)))
    return probe_annotation(fn.apply, args, metas, [TensorMeta(out or shapes[0], "float32", True)])


def test_elementwise_function_gets_every_dim():
    assert _probe(TanhGelu, (4, 6, 8)) == "a b c -> a b c"


def test_row_wise_function_keeps_its_rows_whole():
    assert _probe(RowNorm, (4, 6, 8), (8,)) == "a b c^, c^ -> a b c^"
    assert _probe(Picky, (4, 6)) == "a b^ -> a b^"


def test_several_inputs_broadcasts_and_literal_arguments():
    metas = [TensorMeta((4, 6), "float32", True), TensorMeta((1, 6), "float32", True)]
    args = (Ref("x"), Ref("g"), 0.5)
    got = probe_annotation(ScaledSwiGLU.apply, args, metas, [TensorMeta((4, 6), "float32", True)])
    assert got == "a b, 1 b -> a b"
    metas = [TensorMeta((4, 6), "float32", False)] * 3
    args = ([Ref("x"), Ref("y"), Ref("z")],)
    got = probe_annotation(SumOfList.apply, args, metas, [TensorMeta((4, 6), "float32", False)])
    assert got == "a b, a b, a b -> a b"


def test_large_inputs_are_probed_small_or_else_at_their_traced_sizes():
    assert _probe(TanhGelu, (8, WIDE)) == "a b -> a b"  # at (8, 8)
    assert _probe(WideRows, (8, WIDE)) == "a b^ -> a b^"  # raises at (8, 8): probed at (4, WIDE)
    assert _probe(EightWideRows, (8, WIDE)) == "a^ b -> a^ b"  # and at (4, WIDE): at (8, WIDE)


def test_mixing_dims_are_not_split():
    assert _probe(CumSum, (4, 6)) == "a^ b -> a^ b"


def test_functions_that_are_not_elementwise_stay_unannotated():
    assert _probe(GlobalGrad, (4, 6)) is None  # the backward reads the whole gradient
    assert _probe(Noisy, (4, 6)) is None
    assert _probe(Reduces, (4, 6), out=(6,)) is None
    state = torch.random.get_rng_state()
    _probe(Noisy, (4, 6))
    assert torch.equal(state, torch.random.get_rng_state()), "the probe moved the user's random stream"


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        h = TanhGelu.apply(self.up(x))
        h = CumSum.apply(h)
        return GlobalGrad.apply(self.down(h)).sum()


def test_captured_functions_are_annotated_by_their_probe():
    graph = capture(Mlp(), {"x": torch.randn(4, 8)})
    found = {n.op.rsplit(":", 1)[1]: annotate_node(n, graph) for n in graph.nodes if n.op.endswith(".apply")}
    assert str(found["TanhGelu.apply"]) == "a b -> a b"
    assert str(found["CumSum.apply"]) == "a^ b -> a^ b"
    assert found["GlobalGrad.apply"] is None
    from nnscaler.parallel.unannotated import UnannotatedOpWarning, check_unannotated

    with pytest.warns(UnannotatedOpWarning) as caught:
        check_unannotated(graph)
    assert [str(w.message).split()[1] for w in caught] == [f"{__name__}:GlobalGrad.apply"]


def test_mlp_with_a_function_splits_under_tp():
    from nnscaler import ComputeConfig
    from nnscaler.partition import apply_plan
    from nnscaler.policies import make_plan

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(8, 16)
            self.down = nn.Linear(16, 8)

        def forward(self, x):
            return F.mse_loss(self.down(TanhGelu.apply(self.up(x))), x)

    graph = capture(Net(), {"x": torch.randn(4, 8)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing kept whole for want of an annotation
        program = apply_plan(graph, make_plan(graph, "tp", ComputeConfig(2, 2)))
    (gelu,) = [s for s in program.statements if s.op.endswith("TanhGelu.apply")]
    assert program.local_meta[gelu.outputs[0]].shape == (4, 8)  # half of the 16 features


class EveryOther(torch.autograd.Function):
    """Doubles every other row: splits at even boundaries agree with it, an odd one does not."""

    @staticmethod
    def forward(ctx, x):
        y = x.clone()
        y[::2] = y[::2] * 2
        return y

    @staticmethod
    def backward(ctx, grad):
        g = grad.clone()
        g[::2] = g[::2] * 2
        return g


def test_position_dependent_functions_are_caught_at_an_odd_cut():
    assert _probe(EveryOther, (8, 6)) == "a^ b -> a^ b"
