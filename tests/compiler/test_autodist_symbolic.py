"""Costs as functions of the input sizes: the FLOPs polynomial, and a plan re-costed at new sizes
without tracing again agrees with tracing again."""

from __future__ import annotations

import pytest
import sympy
import torch

from nnscaler import ComputeConfig
from nnscaler.cli.plan import main
from nnscaler.errors import PlanError
from nnscaler.graph.capture import capture
from nnscaler.policies import make_plan
from nnscaler.policies.autodist import planner_setup
from nnscaler.policies.autodist.cost import node_flops
from nnscaler.policies.autodist.evaluate import evaluate_plan
from nnscaler.policies.autodist.symbolic import flops_expr, graph_at_sizes, recost, size_symbols


class TwoLayerAttention(torch.nn.Module):
    """Written for this test: attention FLOPs grow with the square of the sequence, the rest linearly."""

    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.out = torch.nn.Linear(d, d)
        self.ff = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = x + self.out(a.transpose(1, 2).reshape(b, s, d))
        return (h + self.ff(h)).square().mean()


def _graph(batch: int, seq: int):
    torch.manual_seed(0)
    return capture(TwoLayerAttention(), {"x": torch.randn(batch, seq, 32)})


def test_flops_polynomial_matches_the_traced_figures():
    graph = _graph(2, 8)
    expr = flops_expr(graph)
    b, s = size_symbols(graph)["x_size0"], size_symbols(graph)["x_size1"]
    assert sympy.degree(expr, s) == 2 and sympy.degree(expr, b) == 1  # attention: quadratic in seq
    assert float(expr.subs({b: 2, s: 8})) == sum(node_flops(n, graph) for n in graph.nodes)
    other = _graph(3, 20)
    assert float(expr.subs({b: 3, s: 20})) == sum(node_flops(n, other) for n in other.nodes)


@pytest.mark.parametrize("batch,seq", [(6, 8), (2, 40), (5, 24)])
def test_recost_equals_tracing_again(batch, seq):
    graph = _graph(2, 8)
    cfg = ComputeConfig(2, 4, pas_config={"cluster": "h100x8"})
    plan = make_plan(graph, "autodist", cfg)
    again = _graph(batch, seq)
    want = evaluate_plan(again, planner_setup(again, cfg), plan)
    got = recost(graph, cfg, plan, {"x_size0": batch, "x_size1": seq})
    assert got.step_time == pytest.approx(want.step_time, rel=1e-12)
    assert got.memory == pytest.approx(want.memory, rel=1e-12)
    resized = graph_at_sizes(graph, {"x_size1": seq})
    assert resized.values[graph.inputs[0]].meta.shape == (2, seq, 32)
    assert graph.values[graph.inputs[0]].meta.shape == (2, 8, 32)  # the original is untouched


def test_unknown_size_names_are_named():
    graph = _graph(2, 8)
    with pytest.raises(PlanError, match=r"\['seq'\].*x_size0"):
        graph_at_sizes(graph, {"seq": 4})


def test_plan_cli_costs_other_sizes(capsys):
    args = ["--model", "tests.zoo.build_gpt", "--cluster", "h100x8", "--at", "idx_size0=16,targets_size0=16"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "Forward FLOPs of one call: " in printed and "idx_size1**2" in printed
    line = next(x for x in printed.splitlines() if x.startswith("At idx_size0=16"))
    assert "predicted step" in line and "fits" in line
