"""What stays whole (issue 40): the share of parameters and FLOPs each rank holds / computes whole under
a plan over several devices, with the causes named, in CompileResult, the compile log and plan_report.md.

The models are written for these tests: one with three parts that cannot split under `tp` over 2 devices
(an op without an annotation, a linear whose 7 output features do not divide, a leaf module) beside a
Megatron MLP that splits, and one made only of such MLPs.
"""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nnscaler import ComputeConfig
from nnscaler.parallel import CompileResult, compile_module
from nnscaler.parallel.replicated import ReplicatedShare


@torch.library.custom_op("h7_whole::twist", mutates_args=())
def twist(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """An elementwise op nnscaler has no annotation for."""
    return x * scale + 1.0


@twist.register_fake
def _(x, scale):
    return torch.empty_like(x)


class Opaque(nn.Module):
    """Kept as one opaque op (pas_config leaf_modules)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(x)


class PartlyWhole(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)  # column-parallel
        self.down = nn.Linear(32, 16)  # row-parallel; its bias is added whole
        self.scale = nn.Parameter(torch.ones(16))  # read by the unannotated op
        self.opaque = Opaque()
        self.odd = nn.Linear(16, 7, bias=False)  # 7 output features: not 2 ways

    def forward(self, x, y):
        h = self.down(F.gelu(self.up(x)))
        h = twist(h, self.scale)
        h = self.opaque(h)
        return F.mse_loss(self.odd(h), y)


class AllSplit(nn.Module):
    def __init__(self, width: int = 32, layers: int = 2):
        super().__init__()
        self.ups = nn.ModuleList(nn.Linear(width, 4 * width, bias=False) for _ in range(layers))
        self.downs = nn.ModuleList(nn.Linear(4 * width, width, bias=False) for _ in range(layers))

    def forward(self, x, y):
        for up, down in zip(self.ups, self.downs):
            x = x + down(F.gelu(up(x)))
        return F.mse_loss(x, y)


ROWS = 4


def _inputs(out: int = 7):
    return {"x": torch.randn(ROWS, 16), "y": torch.randn(ROWS, out)}


@pytest.fixture(scope="module")
def partly(tmp_path_factory) -> CompileResult:
    torch.manual_seed(0)
    cfg = ComputeConfig(2, 2, pas_config={"leaf_modules": ["Opaque"]})
    return compile_module(PartlyWhole(), _inputs(), "tp", cfg, tmp_path_factory.mktemp("partly"), "test")


def test_partly_whole_shares_match_a_hand_count(partly):
    share = partly.replicated
    assert isinstance(share, ReplicatedShare) and share.tp_size == 2 and share.policy == "tp"
    # parameters (fp32, counted in elements): split: up 16x32 + 32, down 32x16; whole: down's bias 16,
    # scale 16, the leaf's 16x16 + 16, odd 16x7
    split, whole = 16 * 32 + 32 + 32 * 16, 16 + 16 + 16 * 16 + 16 + 16 * 7
    assert share.param_bytes == 4 * (split + whole)
    assert share.param_share == pytest.approx(whole / (split + whole))
    # forward FLOPs: linears 2 x rows x in x out; the leaf as a linear; elementwise ops one per element
    up, gelu, down = 2 * ROWS * 16 * 32, ROWS * 32, 2 * ROWS * 32 * 16
    twist_f, leaf, odd, loss = ROWS * 16, 2 * ROWS * (16 * 16 + 16), 2 * ROWS * 16 * 7, 1
    whole_f = twist_f + leaf + odd + loss
    assert share.flops == pytest.approx(up + gelu + down + whole_f, rel=0.02)
    assert share.flops_share == pytest.approx(whole_f / (up + gelu + down + whole_f), abs=0.01)
    assert len(share.stages) == 1 and share.stages[0].devices == (0, 1)
    # one rank holds the whole weights and half of each split one
    assert share.local_share == pytest.approx((whole + split / 2) / (split + whole))
    assert json.loads(json.dumps(share.to_dict()))["param_share"] == share.param_share
    assert partly.unsplit[0].name == "opaque.lin.weight"  # the largest whole weight, as before


def _reason(share: ReplicatedShare, kind: str):
    found = [r for r in share.reasons if r.kind == kind]
    assert found, f"no {kind!r} reason in {[r.text for r in share.reasons]}"
    return found[0]


def test_partly_whole_reasons_name_each_part(partly):
    share = partly.replicated
    total = share.param_bytes
    unannotated = _reason(share, "unannotated")
    assert "h7_whole.twist" in unannotated.text and "test_replicated_share.py" in unannotated.text
    assert unannotated.param_share == pytest.approx(4 * 16 / total)
    opaque = _reason(share, "opaque")
    assert "opaque" in opaque.text and "opaque region opaque (" in opaque.text
    assert opaque.param_share == pytest.approx(4 * (16 * 16 + 16) / total) and opaque.params == 2
    odd = _reason(share, "indivisible")
    assert "size 7" in odd.text and "2 ways" in odd.text
    assert odd.param_share == pytest.approx(4 * 16 * 7 / total) and odd.params == 1
    bias = _reason(share, "bias")
    assert bias.params == 1 and bias.param_share == pytest.approx(4 * 16 / total)
    assert sum(r.param_share for r in share.reasons) == pytest.approx(share.param_share)
    assert sum(r.flops_share for r in share.reasons) == pytest.approx(share.flops_share)
    # the largest part kept whole comes first
    assert share.reasons[0].kind == "opaque"


def test_fully_split_model_keeps_little_whole(tmp_path):
    torch.manual_seed(0)
    data = {"x": torch.randn(ROWS, 32), "y": torch.randn(ROWS, 32)}
    res = compile_module(AllSplit(), data, "tp", ComputeConfig(2, 2), tmp_path, "test")
    share = res.replicated
    assert share.param_share == 0.0
    assert share.flops_share < 0.05
    assert all(r.kind != "unannotated" for r in share.reasons)


def test_one_device_plan_has_no_share(tmp_path):
    res = compile_module(
        AllSplit(),
        {"x": torch.randn(2, 32), "y": torch.randn(2, 32)},
        "dp",
        ComputeConfig(1, 2),
        tmp_path,
        "t",
    )
    assert res.replicated is None


def test_compile_log_names_the_shares_and_reasons(tmp_path, caplog):
    torch.manual_seed(0)
    cfg = ComputeConfig(2, 2, pas_config={"leaf_modules": ["Opaque"]})
    with caplog.at_level(logging.INFO, logger="nnscaler.parallel.compile"):
        compile_module(PartlyWhole(), _inputs(), "tp", cfg, tmp_path, "test")
    text = caplog.text
    assert "what stays whole" in text and "of the parameters" in text
    assert "h7_whole.twist" in text and "size 7" in text and "opaque region opaque" in text


def test_plan_report_has_the_section(tmp_path):
    torch.manual_seed(0)
    cfg = ComputeConfig(2, 2, pas_config={"leaf_modules": ["Opaque"]})
    res = compile_module(PartlyWhole(), _inputs(), "autodist", cfg, tmp_path, "test")
    report = (res.outdir / "plan_report.md").read_text()
    assert "## What stays whole" in report
    section = report.split("## What stays whole", 1)[1].split("\n## ", 1)[0]
    share = res.replicated
    assert f"holds {share.param_share:.1%} of the parameters" in section
    assert "h7_whole.twist" in section and "opaque region opaque" in section
    # what autodist itself kept whole is named as its choice, with the costs behind it
    planner = [r for r in share.reasons if r.kind.startswith("planner")]
    assert all("autodist chose to replicate" in r.text for r in planner)
    assert all(math.isfinite(r.saved_ms) and r.comm_ms > 0 for r in planner if r.ops)


def test_pipeline_only_plan_says_so(tmp_path):
    torch.manual_seed(0)
    data = {"x": torch.randn(ROWS, 32), "y": torch.randn(ROWS, 32)}
    cfg = ComputeConfig(2, 2, use_end2end=True, pas_config={"pipeline_nmicros": 2})
    res = compile_module(AllSplit(layers=4), data, "pp", cfg, tmp_path, "test")
    share = res.replicated
    assert share.tp_size == 1 and len(share.stages) == 2
    assert share.param_share == 1.0 and share.reasons[0].kind == "pipeline-only"
    assert [s.devices for s in share.stages] == [(0,), (1,)]


def test_batch_split_keeps_weights_whole_and_says_why(tmp_path):
    data = {"x": torch.randn(ROWS, 32), "y": torch.randn(ROWS, 32)}
    res = compile_module(AllSplit(), data, "data", ComputeConfig(2, 2), tmp_path, "test")
    share = res.replicated
    assert share.param_share == 1.0 and share.flops_share < 0.05
    assert share.reasons[0].kind == "data-parallel" and share.reasons[0].params == 4


class Downstream(nn.Module):
    """A cheap unannotated op, then a much bigger elementwise op (and its weight) on its whole output."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(16))
        self.wide = nn.Parameter(torch.ones(16, 64))

    def forward(self, x, y):
        h = twist(x, self.scale).unsqueeze(-1) * self.wide
        return F.mse_loss(h.sum(-1), y)


def test_ops_downstream_of_a_whole_op_take_its_cause(tmp_path):
    data = {"x": torch.randn(ROWS, 16), "y": torch.randn(ROWS, 16)}
    res = compile_module(Downstream(), data, "tp", ComputeConfig(2, 2), tmp_path, "test")
    share = res.replicated
    cause = share.reasons[0]
    assert cause.kind == "unannotated" and cause.params == 2 and share.param_share == 1.0
    assert cause.ops > 1 and cause.example.startswith("h7_whole.twist.default")  # named by its own op
