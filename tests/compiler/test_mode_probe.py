"""The second (other-mode) trace is skipped for forwards that read the mode but call the same ops on
the same values in both modes; any difference in an op, an argument, a tensor's origin or the returned
values keeps it."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nnscaler
from nnscaler.graph.capture import capture
from nnscaler.graph.capture.mode_probe import modes_trace_alike
from nnscaler.graph.capture.mode_reads import reads_training


class Attention(nn.Module):
    """transformers' pattern: the dropout probability chosen by mode, 0 in both by configuration."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.dropout = dropout
        self.norm = nn.LayerNorm(8)

    def forward(self, x, labels):
        q, k, v = self.qkv(self.norm(x)).unflatten(-1, (3, 2, 4)).unbind(-3)
        p = 0.0 if not self.training else self.dropout
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=p
        )
        return F.mse_loss(out.transpose(1, 2).flatten(-2), labels)


class ParamByMode(nn.Module):
    """Two weights of one shape: which one is used depends on the mode (same ops, other wiring)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(4, 4))
        self.b = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return (x @ (self.a if self.training else self.b)).sum()


class AttributeByMode(nn.Module):
    """Plain tensor attributes (neither parameters nor buffers) chosen by mode."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.shift_train = torch.ones(4)
        self.shift_eval = torch.zeros(4)

    def forward(self, x):
        return (self.fc(x) + (self.shift_train if self.training else self.shift_eval)).sum()


class ReturnByMode(nn.Module):
    """Every op runs in both modes; only which result is returned depends on the mode."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        first, second = h.sum(), (h * 2).sum()
        return first if self.training else second


class ScaleByMode(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return (self.fc(x) * (1.0 if self.training else 2.0)).sum()


class ExportOnlyBranch(nn.Module):
    """Differs only where torch.export is tracing: the probe must run as the trace does."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if torch.compiler.is_exporting() and self.training:
            h = h + 1
        return h.sum()


class AutocastInTraining(nn.Module):
    """The same calls in both modes; only the dtypes they return differ."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.training):
            return self.fc(x).sum()


class NoGradInTraining(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad() if self.training else contextlib.nullcontext():
            h = self.fc(x)
        return (h * x).sum()


def _x():
    return {"x": torch.randn(3, 4)}


@pytest.mark.parametrize(
    "model",
    [
        ParamByMode(),
        AttributeByMode(),
        ReturnByMode(),
        ScaleByMode(),
        ExportOnlyBranch(),
        AutocastInTraining(),
        NoGradInTraining(),
    ],
)
def test_any_difference_between_the_modes_keeps_the_second_trace(model):
    assert reads_training(model)
    assert not modes_trace_alike(model.train(), _x())
    assert not modes_trace_alike(model.eval(), _x())


def test_dropout_that_is_zero_in_both_modes_traces_alike_and_dropout_that_is_not_does_not():
    batch = {"x": torch.randn(2, 5, 8), "labels": torch.randn(2, 5, 8)}
    assert reads_training(Attention())
    assert modes_trace_alike(Attention(0.0), batch)
    assert not modes_trace_alike(Attention(0.1), batch)


def test_probe_leaves_modes_and_weights_as_they_were():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.0)).train()
    model[1].eval()  # frozen statistics inside a model in train mode
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modes_trace_alike(model, _x())
    assert model.training and not model[1].training and model[2].training
    for k, v in model.state_dict().items():
        assert not v.is_meta and torch.equal(v, before[k]), k  # no fake or meta weights left behind


def test_a_model_that_traces_alike_is_exported_once_and_follows_either_mode(monkeypatch, tmp_path):
    from nnscaler.graph.capture.export import export_module

    exports = []
    monkeypatch.setattr(
        "nnscaler.graph.capture.export_module", lambda *a, **k: exports.append(1) or export_module(*a, **k)
    )
    batch = {"x": torch.randn(2, 5, 8), "labels": torch.randn(2, 5, 8)}
    capture(Attention(0.0), batch)
    assert len(exports) == 1
    capture(Attention(0.1), batch)
    assert len(exports) == 3  # one per mode

    torch.manual_seed(0)
    model = Attention(0.0)
    pm = nnscaler.parallelize(model, batch, "dp", nnscaler.ComputeConfig(1, 1), gen_savedir=tmp_path)
    other = {"x": torch.randn(3, 7, 8), "labels": torch.randn(3, 7, 8)}  # other batch and length
    for training in (True, False):
        model.train(training)
        pm.train(training)
        torch.testing.assert_close(pm(**other), model(**other))
