"""Bad input gets a clear error naming the cause."""

from __future__ import annotations

import pytest
import torch

from nnscaler import ComputeConfig, parallelize
from nnscaler.errors import ConfigError, TraceError


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:  # data-dependent control flow
            return y.sum()
        return -y.sum()


class Noisy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.bernoulli(torch.sigmoid(self.lin(x))).sum()


class TwoArgs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, y):
        return (self.lin(x) - y).pow(2).mean()


def test_runtime_ngpus_not_multiple_of_plan_ngpus():
    with pytest.raises(ConfigError, match=r"runtime_ngpus \(3\) must be a multiple of plan_ngpus \(2\)"):
        ComputeConfig(2, 3)


def test_missing_forward_argument(tmp_path):
    with pytest.raises(TraceError, match="missing forward argument 'y'"):
        parallelize(TwoArgs(), {"x": torch.randn(2, 4)}, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path)


def test_data_dependent_control_flow_names_source_line(tmp_path):
    with pytest.raises(TraceError, match=r"data-dependent control flow at .*test_errors.py.*line 19"):
        parallelize(Branchy(), {"x": torch.randn(2, 4)}, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path)


def test_unannotated_op_that_cannot_be_replicated(tmp_path):
    with pytest.raises(
        TraceError, match=r"aten.bernoulli.default at test_errors.py:30.*no annotation.*register_op"
    ):
        parallelize(Noisy(), {"x": torch.randn(2, 4)}, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path)


def test_unknown_policy(tmp_path):
    from nnscaler.errors import PlanError

    with pytest.raises(PlanError, match="unknown pas_policy 'zz'"):
        parallelize(
            TwoArgs(),
            {"x": torch.randn(2, 4), "y": torch.randn(2, 4)},
            "zz",
            ComputeConfig(1, 1),
            gen_savedir=tmp_path,
        )
