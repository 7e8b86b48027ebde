"""What the trace keeps of train()/eval() and of branches on sizes (issue 9).

Mode-dependent op arguments become ModeValues (generated code reads `self.training`); a Python
branch on `self.training` is reported; a branch on an input size is followed or checked at call time.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nnscaler
from nnscaler.codegen.expr import Formatter
from nnscaler.graph.capture import capture
from nnscaler.graph.capture.modes import ModeWarning
from nnscaler.graph.ir import ModeValue, graph_from_json, graph_to_json


class DropNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.free = nn.BatchNorm1d(8, track_running_stats=False)  # batch statistics in both modes

    def forward(self, x):
        h = self.bn(self.fc(x))
        d = F.dropout(h, 0.2, self.training)
        q = F.scaled_dot_product_attention(
            d[None, None], d[None, None], d[None, None], dropout_p=0.1 if self.training else 0.0
        )
        return self.free(h + d + q[0, 0]).sum()


def _mode_args(graph):
    return {
        n.op: [a for a in [*n.args, *n.kwargs.values()] if isinstance(a, ModeValue)]
        for n in graph.nodes
        if any(isinstance(a, ModeValue) for a in [*n.args, *n.kwargs.values()])
    }


@pytest.mark.parametrize("training", [True, False])
def test_mode_dependent_arguments_are_marked_in_either_mode(training):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModeWarning)
        graph = capture(DropNorm().train(training), {"x": torch.randn(4, 8)})
    marked = _mode_args(graph)
    assert marked == {
        "aten.add_.Tensor": [ModeValue(1, 0)],  # num_batches_tracked += 1 only when training
        "aten.batch_norm.default": [ModeValue(True, False)],
        "aten.dropout.default": [ModeValue(True, False)],
        "aten.scaled_dot_product_attention.default": [ModeValue(0.1, 0.0)],
    }
    free = [n for n in graph.nodes if n.op == "aten.batch_norm.default"][-1]
    assert free.args[5] is True  # no running statistics: batch statistics in eval mode too
    # the dropout's consumers read its input and its output as written, in either traced mode
    add = next(n for n in graph.nodes if n.op == "aten.add.Tensor")
    assert [r.name for r in add.args] == ["batch_norm", "dropout"]
    assert _mode_args(graph_from_json(graph_to_json(graph))) == marked


def test_mode_values_render_as_self_training():
    fmt = Formatter(0, set())
    assert fmt(ModeValue(True, False)) == "self.training"
    assert fmt(ModeValue(False, True)) == "(not self.training)"
    assert fmt(ModeValue(0.1, 0.0)) == "(0.1 if self.training else 0.0)"


class TrainOnlyBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = F.dropout(self.fc(x), 0.5, self.training)
        if self.training:
            h = h * 2
        return h.sum()


def test_python_branch_on_training_is_reported_and_mode_kept():
    with pytest.warns(ModeWarning, match=r"test_modes.py:\d+ `h = h \* 2`.*runs as in train mode"):
        graph = capture(TrainOnlyBranch().train(), {"x": torch.randn(2, 4)})
    assert not _mode_args(graph)
    drop = next(n for n in graph.nodes if n.op == "aten.dropout.default")
    assert drop.args[2] is True  # baked: the whole module keeps its traced mode


class SizeBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if x.shape[0] > 4:
            return (h * 2).sum()
        return (h * 3).sum()


def test_branch_on_a_size_is_followed_or_refused_at_call_time(tmp_path):
    torch.manual_seed(0)
    model = SizeBranch()
    pm = nnscaler.parallelize(
        model, {"x": torch.randn(8, 4)}, "dp", nnscaler.ComputeConfig(1, 1), gen_savedir=tmp_path
    )
    for rows in (6, 8, 16):  # the traced side of the branch
        x = torch.randn(rows, 4)
        torch.testing.assert_close(pm(x=x), model(x=x))
    for rows in (1, 2, 4):  # the other side: the same result as the model, or a clear error
        x = torch.randn(rows, 4)
        try:
            got = pm(x=x)
        except ValueError as exc:
            assert "x" in str(exc) and "shape" in str(exc).lower(), str(exc)
        else:
            torch.testing.assert_close(got, model(x=x))


def test_submodule_modes_are_kept():
    """A frozen batch norm (eval inside a model in train mode) stays frozen, and stays so after capture."""
    model = DropNorm().train()
    model.bn.eval()
    graph = capture(model, {"x": torch.randn(4, 8)})
    assert model.training and not model.bn.training and model.free.training
    bn = next(n for n in graph.nodes if n.op == "aten.batch_norm.default")
    assert bn.args[5] is False
    assert _mode_args(graph)["aten.dropout.default"] == [ModeValue(True, False)]
