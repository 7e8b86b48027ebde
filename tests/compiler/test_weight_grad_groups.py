"""Which weights the partition hands to the reducer (`Program.grad_groups`) instead of `copy_to_group`."""

from __future__ import annotations

import torch
from torch import nn

from nnscaler import ComputeConfig
from nnscaler.graph.capture import capture
from nnscaler.partition import GROUP, apply_plan
from nnscaler.policies import make_plan


class _Mixed(nn.Module):
    """`w` is read by a batch-split linear and by `w.sum()`, which runs whole on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))
        self.v = nn.Parameter(torch.randn(8, 8))
        self.frozen = nn.Parameter(torch.randn(8, 8), requires_grad=False)

    def forward(self, x):
        h = nn.functional.linear(x, self.w) + self.w.sum()
        return nn.functional.linear(nn.functional.linear(h, self.v), self.frozen).sum()


def _program(fold: bool):
    graph = capture(_Mixed(), {"x": torch.randn(4, 8)})
    return apply_plan(graph, make_plan(graph, "data", ComputeConfig(2, 4)), fold_weight_grads=fold)


def _f_inputs(program) -> list[str]:
    return [s.args[0].name for s in program.statements if s.op == "copy_to_group"]


def test_only_weights_read_alike_move_to_the_reducer() -> None:
    before, after = _program(False), _program(True)
    names = {t.name: t.original_name for t in after.tensors}
    by_original = {v: k for k, v in names.items()}
    w, v = by_original["w"], by_original["v"]
    assert set(_f_inputs(before)) >= {w, v}
    # v: every reader split on the batch -> the reducer; w: one reader runs whole -> keeps its f (a sum
    # over the ranks would count that reader's gradient twice); frozen: no gradient at all
    assert after.grad_groups == {v: (GROUP,)}
    assert w in _f_inputs(after) and v not in _f_inputs(after)
    assert by_original["frozen"] not in after.grad_groups
    assert after.comm_count().get("copy_to_group", 0) == before.comm_count()["copy_to_group"] - 1
