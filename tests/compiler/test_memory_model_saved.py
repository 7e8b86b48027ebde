"""The memory model against hand-computed bytes (issue 42): what autograd saves for backward
(saved_tensors.py), recompute, ZeRO's division of parameter state, a pipeline stage's micro-batches in
flight, and the transient working sets (transients.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nnscaler import ComputeConfig
from nnscaler.graph.capture import capture
from nnscaler.policies.autodist import load_cluster, planner_setup
from nnscaler.policies.autodist.context import stage_context, transient_bytes
from nnscaler.policies.autodist.cost import CostContext
from nnscaler.policies.autodist.evaluate import evaluate_nodes
from nnscaler.policies.autodist.memory import MemoryModel

B, D, H = 8, 16, 32
F32 = 4


class Block(nn.Module):
    """relu(fc1(x)) read by two linears (once through a view), their sum: the relu output is the one
    activation fc2, fc3 and relu itself save; linear's output feeding relu and add is not saved."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(D, H), nn.Linear(H, D), nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(x))
        return self.fc2(h) + self.fc3(h.view(2, B // 2, H)).view(B, D)


class Net(nn.Module):
    """pre (a linear) -> Block -> Block -> sum of squares (the mul saves its input: the last block's
    output is kept like every block's, as the layers' fold assumes)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(D, D)
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pre(x)
        for b in self.blocks:
            y = b(y)
        return (y * y).sum()


@pytest.fixture(scope="module")
def net_graph():
    torch.manual_seed(0)
    return capture(Net().train(), {"x": torch.randn(B, D)}, both_modes=False)


def _setup(graph, plan_ngpus=1, runtime_ngpus=1, **pas):
    cfg = ComputeConfig(plan_ngpus, runtime_ngpus, pas_config=pas)
    return planner_setup(graph, cfg, cluster=load_cluster("cpu_gloo"))


def _activations(cand, graph, names=None) -> float:
    names = names or [n.name for n in graph.nodes]
    return sum(cand.spmd.choice[n].activation_bytes for n in names)


PARAMS = (D * D + D) + 2 * (D * H + H + 2 * (H * D + D))
"""Parameters of Net."""


def test_saved_activations_by_hand(net_graph):
    """Per block: the relu output h (B x H fp32) once, though relu, fc2 and fc3 (through a view) all
    save it, and the block's output (B x D: saved by the next fc1 or the final mul; the add making it
    saves nothing); pre's output (B x D) saved by block 0's fc1. The input x, fc1's output (relu keeps
    its output), the mul and sum outputs are not kept."""
    cand = evaluate_nodes(net_graph, _setup(net_graph), {})
    per_block = B * H * F32 + B * D * F32
    assert _activations(cand, net_graph) == 2 * per_block + B * D * F32
    weights = PARAMS * F32
    # one replica, one micro-batch: no reducer keeps the gradients, and backward makes them as it frees
    # the activations, so the peak holds the larger of the two beside the weights and Adam's moments
    acts = _activations(cand, net_graph)
    assert weights * (1 + 2) + max(weights, acts) <= cand.memory < weights * (1 + 1 + 2) + acts
    # with a second micro-batch the first one's gradients wait beside the second's activations
    two = evaluate_nodes(net_graph, _setup(net_graph), {}, nmicros=2)
    assert two.memory == weights * (1 + 1 + 2) + acts


def test_gradients_replace_activations_without_a_reducer():
    """MemoryModel.peak_state by hand: weights 10, gradients 10, Adam 20, activations 30."""
    from nnscaler.policies.autodist.memory import MemoryModel

    parts = {"weights": 10.0, "gradients": 10.0, "optimizer": 20.0}
    memory = MemoryModel()
    assert memory.peak_state(parts, 30.0, grads_persist=True) == 70.0
    assert memory.peak_state(parts, 30.0, grads_persist=False) == 60.0
    assert memory.peak_state(parts, 5.0, grads_persist=False) == 40.0
    assert memory.peak_state(parts, 30.0, grads_persist=False, backward_peak=33.0) == 63.0
    # three ops saving activations 4, 2, 6, with weights whose gradients are 1, 5, 0 bytes. Alive:
    # before backward 4 + 2 + 6 = 12; after op 2's backward 4 + 2 + 0 = 6; after op 1's 4 + 5 + 0 = 9;
    # after op 0's 1 + 5 + 0 = 6
    assert MemoryModel.backward_live_peak([4.0, 2.0, 6.0], [1.0, 5.0, 0.0]) == 12.0
    assert MemoryModel.backward_live_peak([1.0, 1.0, 1.0], [5.0, 0.0, 0.0]) == 5.0
    assert MemoryModel.backward_live_peak([3.0, 0.0], [0.0, 4.0]) == 7.0  # act of op 0 + op 1's grad


def test_recompute_keeps_only_module_inputs(net_graph):
    """Both blocks recomputed: kept are their inputs (pre's output and block 0's output, B x D each)
    and block 1's output (the final mul saves it); while a block's backward reruns it, it saves its
    relu output again (recompute_peak; its input is kept anyway, its output is not saved inside)."""
    from nnscaler.policies.autodist.saved_tensors import recompute_peak

    paths = ("blocks.0", "blocks.1")
    setup = _setup(net_graph)
    cand = evaluate_nodes(net_graph, setup, {}, recompute=paths)
    assert _activations(cand, net_graph) == 3 * B * D * F32
    ctx = stage_context(setup, 1)
    assert recompute_peak(net_graph, paths, ctx) == B * H * F32
    assert transient_bytes(net_graph, ctx, setup, paths) >= B * H * F32


@pytest.mark.parametrize(
    "zero,mixed,expect",
    [
        (0, False, (1000, 1000, 2000)),
        (1, False, (1000, 1000, 500)),
        (2, False, (1000, 250, 500)),
        (3, False, (250, 250, 500)),
        (3, True, (250, 250, 1500)),  # bf16 weights: fp32 moments (4 bytes each) + fp32 master = 6x
    ],
)
def test_zero_divides_parameter_state(zero, mixed, expect):
    ctx = CostContext(load_cluster("cpu_gloo"), dp_size=4)
    parts = MemoryModel(zero, mixed_precision=mixed).param_state_parts(1000.0, ctx)
    assert (parts["weights"], parts["gradients"], parts["optimizer"]) == expect


def test_zero3_holds_gathered_blocks(net_graph):
    """ZeRO-3 over 2 replicas: the gathered largest block (blocks.N: fc1 + fc2 + fc3, whole) lives beside
    the usual transient buffers (transients.ZERO3_BLOCKS_LIVE)."""
    plain = transient_bytes(net_graph, stage_context(_setup(net_graph, 1, 2), 1), _setup(net_graph, 1, 2))
    zsetup = _setup(net_graph, 1, 2, zero_stage=3)
    block = (D * H + H + 2 * (H * D + D)) * F32
    assert transient_bytes(net_graph, stage_context(zsetup, 1), zsetup) == plain + block


def test_pipeline_stage_keeps_micro_batches_in_flight(net_graph):
    """Two stages (pre + block 0 | block 1), 4 micro-batches: stage 0 keeps min(2 - 0, 4) = 2
    micro-batches of its activations, stage 1 one (a value crossing stages counts where it is made)."""
    setup = _setup(net_graph, 2, 2)
    start1 = next(i for i, n in enumerate(net_graph.nodes) if n.module_path.startswith("blocks.1"))
    cand = evaluate_nodes(net_graph, setup, {}, pp=2, starts=[0, start1], nmicros=4)
    act0 = 2 * B * D * F32 + B * H * F32  # pre's output, block 0's relu output and output
    act1 = B * D * F32 + B * H * F32  # block 1's relu output and output
    w0 = ((D * D + D) + (D * H + H + 2 * (H * D + D))) * F32
    w1 = (D * H + H + 2 * (H * D + D)) * F32
    assert cand.memory == max(4 * w0 + 2 * act0, 4 * w1 + act1)


def test_experts_backward_reruns_its_forward():
    """An experts op's backward reruns its forward under autograd (runtime/moe/op.py): per routed row
    (tokens x top-k) it saves the gathered hidden state and the down projection's output (h each), the
    gate/up output (2i), the activation and the gated product (i each)."""
    from nnscaler.policies.autodist.transients import moe_rerun_bytes
    from tests import zoo

    model, make_batch = zoo.build("mixtral")
    graph = capture(model, make_batch(1, 4), both_modes=False)
    t, k, h, i = 4 * 16, 2, 64, 128  # tests/zoo.py build_mixtral: batch 4 x 16 tokens, top-2 of 4 experts
    ctx = CostContext(load_cluster("cpu_gloo"))
    assert moe_rerun_bytes(graph, ctx) == t * k * (2 * h + 4 * i) * F32
    # over 2 tensor-parallel devices the intermediate size splits, the h-wide rows stay whole
    assert moe_rerun_bytes(graph, replace(ctx, ways=2)) == t * k * (2 * h + 4 * i / 2) * F32
