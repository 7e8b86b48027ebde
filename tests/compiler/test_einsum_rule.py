"""einsum's annotation is read off its equation (issue 40), and tp treats an einsum of an activation
and a weight as a linear: column-parallel on the weight's new output letter, row-parallel on the
letter it sums with the activation. Numerics of every split: test_op_fuzz.py (aten.einsum.default)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nnscaler import ComputeConfig
from nnscaler.graph.capture import capture
from nnscaler.graph.ops.annotation import AnnotationError
from nnscaler.graph.ops.einsum import einsum_annotation
from nnscaler.policies import make_plan
from nnscaler.policies.weighted import weighted_op


@pytest.mark.parametrize(
    "equation, shapes, expected",
    [
        ("ij,jk->ik", [(2, 3), (3, 4)], "i j+, j+ k -> i k"),
        ("bhqd,bhkd->bhqk", [(2, 4, 6, 8), (2, 4, 5, 8)], "b h q d+, b h k d+ -> b h q k"),
        ("i,j->ij", [(2,), (3,)], "i, j -> i j"),
        ("ii->i", [(3, 3)], "i^ i^ -> i^"),
        ("ii", [(3, 3)], "i^ i^ -> "),  # implicit: a repeated letter is summed (trace)
        ("aB,Ca", [(2, 3), (4, 2)], "a+ B, C a+ -> B C"),  # implicit: sorted, capitals first
        ("...ij,jk", [(5, 2, 3), (3, 4)], "_e0 i j+, j+ k -> _e0 i k"),
        ("...ij->j", [(5, 2, 3)], "_e0+ i+ j -> j"),  # '...' left out of the output: summed
        ("...d,...d->...", [(5, 1, 3), (2, 3)], "_e0 1 d+, _e1 d+ -> _e0 _e1"),
        ("bi, ij ,jk -> bk", [(2, 3), (3, 4), (4, 5)], "b i+, i+ j+, j+ k -> b k"),
        ("bsd,bd->bs", [(4, 5, 6), (1, 6)], "b s d+, 1 d+ -> b s"),
    ],
)
def test_annotation_from_the_equation(equation, shapes, expected):
    assert einsum_annotation(equation, shapes) == expected
    operands = [torch.randn(s) for s in shapes]
    out = torch.einsum(equation, *operands)
    ids = expected.split("->")[1].split()
    assert len(ids) == out.dim()  # the output annotation has the traced output's rank


def test_flops_count_every_letter_once():
    from nnscaler.graph.ops.einsum import einsum_flops

    assert einsum_flops("bhqd,bhkd->bhqk", [(2, 4, 6, 8), (2, 4, 5, 8)]) == 2 * 2 * 4 * 6 * 5 * 8
    assert einsum_flops("...ij,jk", [(5, 2, 3), (3, 4)]) == 2 * 5 * 2 * 3 * 4
    assert einsum_flops("bsd,fd->bsf", [(2, 3, 8), (16, 8)]) == 2 * 2 * 3 * 8 * 16


def test_malformed_equations_raise():
    with pytest.raises(AnnotationError, match="operands"):
        einsum_annotation("ij,jk->ik", [(2, 3)])
    with pytest.raises(AnnotationError, match="labels for 3 dims"):
        einsum_annotation("ij->i", [(2, 3, 4)])


class HeadProjections(nn.Module):
    """Multi-head projections written with einsum: q by heads, then the output projection."""

    def __init__(self):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(4, 8, 2))  # (heads, width, head_dim)
        self.w_out = nn.Parameter(torch.randn(4, 2, 8))
        self.w_flat = nn.Parameter(torch.randn(16, 8))

    def forward(self, x):
        h = torch.relu(torch.einsum("bsd,hde->bhse", x, self.w_in))
        y = x + torch.einsum("bhse,hed->bsd", h, self.w_out)
        z = torch.einsum("fd,bsd->bsf", self.w_flat, y)
        scores = torch.einsum("bsf,btf->bst", z, z)  # two activations: not a linear
        return scores.sum()


def test_einsum_projections_are_linears_under_tp():
    graph = capture(HeadProjections(), {"x": torch.randn(2, 3, 8)})
    einsums = [n for n in graph.nodes if n.op == "aten.einsum.default"]
    found = [weighted_op(graph, n) for n in einsums]
    assert [(w.k, w.n, w.k_dim, w.weight_index) for w in found[:3]] == [
        ("d", "h", 2, 1),
        ("h", "d", 1, 1),
        ("d", "f", 2, 0),
    ]
    assert found[3] is None
    plan = make_plan(graph, "tp", ComputeConfig(2, 2))
    notes = [(plan.nodes[n.name].split, plan.nodes[n.name].note) for n in einsums[:2]]
    assert notes == [("h", "column-parallel"), ("h", "row-parallel")]


def test_cost_model_counts_einsum_by_its_equation():
    """`bhse,hed->bsd` sums over h and e: not operand 0's last dim alone (that would miss h)."""
    from nnscaler.policies.op_cost import node_flops

    graph = capture(HeadProjections(), {"x": torch.randn(2, 3, 8)})
    out_proj = [n for n in graph.nodes if n.op == "aten.einsum.default"][1]
    assert node_flops(out_proj, graph) == 2 * 2 * 3 * 8 * 4 * 2  # b s d h e
