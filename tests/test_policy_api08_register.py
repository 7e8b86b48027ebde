"""Ops registered the way nnScaler 0.8's examples register them (swin's window_attn / drop_path) trace,
split and train like the single-device model: '?' for an argument passed as None, an integer argument
named like an identifier (its size; divided by the pieces in local code), an integer tensor input,
and an op returning its input."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import nnscaler
from nnscaler import ComputeConfig
from nnscaler.graph import IRGraph
from nnscaler.graph.capture import capture
from nnscaler.graph.parser.register import register_op
from nnscaler.ir.operator import IRFwOperation
from nnscaler.policies import make_plan
from tests import zoo
from tests.parity import ParityCase, run_parity_many


@register_op("B N^ C^, (h+ d^) C^, ?, N^ -> B N^ C^")
def heads_mix(x: torch.Tensor, w: torch.Tensor, mask: Optional[torch.Tensor], pos: torch.Tensor, h: int):  # noqa: UP045
    """Per-head projections (heads from `h`), scaled by an integer position tensor, summed over heads."""
    b, n, _ = x.shape
    y = F.linear(x, w).reshape(b, n, h, -1) * (pos.float()[None, :, None, None] + 1.0)
    if mask is not None:
        y = y.masked_fill(mask[None, :, None, None], 0.0)
    return torch.einsum("bnhd,hdc->bnc", y, w.reshape(h, -1, w.shape[-1]))


@nnscaler.register_op("* c -> * c")
def maybe_scale(x: torch.Tensor, rate: float):
    """Returns its input when rate is 0 (as swin's drop_path does)."""
    return x if rate == 0.0 else x * rate


class HeadsModel(nn.Module):
    def __init__(self, c: int = 16, heads: int = 4, n: int = 8):
        super().__init__()
        self.inp = nn.Linear(c, c)
        self.w = nn.Parameter(torch.randn(heads * 4, c) * 0.1)
        self.register_buffer("pos", torch.arange(n))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = heads_mix(self.inp(x), self.w, None, self.pos, self.heads)
        return maybe_scale(y, 0.0).pow(2).mean()


def build_heads(seed: int = 0):
    torch.manual_seed(seed)

    def make_batch(seed: int, batch_size: int) -> dict:
        return {"x": torch.randn(batch_size, 8, 16, generator=torch.Generator().manual_seed(seed))}

    return HeadsModel().train(), make_batch


zoo.MODELS.setdefault("heads08", build_heads)  # spawned ranks import this module with the policy


def split_heads(graph: IRGraph, cfg: ComputeConfig) -> IRGraph:
    devs = list(range(cfg.plan_ngpus))
    for node in graph.select(name="heads_mix"):
        for dev, sub in zip(devs, graph.partition(node, node.algorithm("dim"), idx=1, dim=0, num=len(devs))):
            graph.assign(sub, dev)
    for node in graph.select(ntype=IRFwOperation):
        if not node.device:
            for dev, sub in zip(devs, graph.replicate(node, times=len(devs))):
                graph.assign(sub, dev)
    return graph


def test_annotation_fits_the_call_and_the_split_is_on_heads():
    model, make_batch = build_heads()
    graph = capture(model, make_batch(1, 2))
    plan = make_plan(graph, split_heads, ComputeConfig(2, 2))
    (name,) = [n.name for n in graph.nodes if n.op.endswith("heads_mix.default")]
    assert plan.node(name).describe() == "h/2"


def test_registered_ops_split_like_nnscaler_train_like_single_device(tmp_path):
    run_parity_many([ParityCase("heads08", split_heads, 2, optimizer="sgd")], 2, tmp_path=tmp_path, steps=2)
