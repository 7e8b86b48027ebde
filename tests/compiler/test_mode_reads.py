"""The second (other-mode) trace is skipped only for forwards that cannot depend on train()/eval()."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from nnscaler.graph.capture import capture, mode_reads
from nnscaler.graph.capture.mode_reads import reads_training


def _drop_if(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.dropout(x, 0.5, module.training)  # reached through a global helper, not the class


def _helper_of_helper(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _drop_if(module, x) * 2


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.fc(x)).sum()


class ThroughHelpers(Plain):
    def forward(self, x):
        return _helper_of_helper(self, self.fc(x)).sum()


class ByGetattr(Plain):
    def forward(self, x):
        mode = "training"
        return self.fc(x).sum() * (2.0 if getattr(self, mode) else 1.0)


class InClosure(Plain):
    def forward(self, x):
        def inner(y):
            return y * 3 if self.training else y

        return inner(self.fc(x)).sum()


class WithDropout(Plain):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.drop(self.fc(x)).sum()


def test_plain_model_reads_no_mode():
    assert not reads_training(Plain())
    assert not reads_training(nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.LayerNorm(4)))


def test_every_way_to_read_the_mode_is_found():
    for model in (ThroughHelpers(), ByGetattr(), InClosure(), WithDropout(), nn.BatchNorm1d(4)):
        assert reads_training(model), type(model).__name__


def test_hooks_are_scanned_and_opaque_hooks_count_as_reads():
    model = Plain()
    handle = model.fc.register_forward_hook(lambda m, i, o: o * (2 if m.training else 1))
    assert reads_training(model)
    handle.remove()
    model.fc.register_forward_hook(functools.partial(lambda m, i, o: o))
    assert reads_training(model)  # a partial cannot be read: assume it does


def test_skipped_trace_and_kept_trace_give_the_module_s_program(monkeypatch):
    calls = []
    real = mode_reads.reads_training
    monkeypatch.setattr(
        "nnscaler.graph.capture.modes.reads_training", lambda m: calls.append(real(m)) or calls[-1]
    )
    x = torch.randn(3, 4)
    for model, reads in ((Plain(), False), (ThroughHelpers(), True)):
        graph = capture(model, {"x": x})
        assert calls[-1] is reads
        ops = [n.op for n in graph.nodes]
        assert any("dropout" in op for op in ops) is reads, ops
