"""Run-time sizes used as operands keep their precedence in the generated code.

transformers' Mixtral/Qwen2-MoE auxiliary loss divides by `total_rows`, a Python float summed from
`routing_weights.shape[0]` per layer: with dynamic shapes it is the run-time size
`2*torch.sym_float(b*s)`, and `x / 2*n` (what codegen wrote) is `(x / 2) * n`. The captured program
now computes what the model computes (parallelize's verify), and the rendered operands are
parenthesised only where precedence needs it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from nnscaler.codegen.expr import _operand
from nnscaler.graph.capture import capture
from nnscaler.parallel.verify import verify_capture
from nnscaler.parallel.verify_program import single_device_source


class MeanOverRows(nn.Module):
    """A loss divided by a float accumulated from the batch's shape, as HF's load-balancing loss does."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = 0.0
        for _ in range(2):
            rows = rows + x.shape[0] * x.shape[1]
        total = self.proj(x).sum() / rows
        return total - 1.0 / (x.shape[0] - 0.5)


def test_divide_by_a_run_time_product_matches_eager():
    model = MeanOverRows()
    x = torch.randn(3, 5, 8)
    graph = capture(model, {"x": x})
    source = single_device_source(graph)
    assert "/ 2*" not in source and "/ (2*" in source
    verify_capture(model, {"x": x}, graph)  # raises CompileError where the program differs


def test_operand_parenthesises_only_compound_expressions():
    assert _operand("x") == "x"
    assert _operand("self.weight") == "self.weight"
    assert _operand("1e-05") == "1e-05"
    assert _operand("torch.sym_float(a)") == "torch.sym_float(a)"
    assert _operand("2*torch.sym_float(a*b)") == "(2*torch.sym_float(a*b))"
    assert _operand("-1") == "(-1)"
    assert _operand("a - b") == "(a - b)"
