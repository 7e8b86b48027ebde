"""A 2-D policy for tests: the batch over mesh axis 0 and Megatron's split over axis 1, per node.

Written from the two 1-D policies so the parity tests exercise 2-D splits on every zoo op they reach,
not just the ones a search happens to pick."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nnscaler import ComputeConfig
from nnscaler.graph.ir import Graph
from nnscaler.graph.ops import annotate_node, get_rule, mesh_layouts_for
from nnscaler.policies import NodePlan, Plan
from nnscaler.policies.builtin import pas_data
from nnscaler.policies.tp import pas_tp


def data_x_tp(graph: Graph, cfg: ComputeConfig) -> Plan:
    """Mesh (2, plan_ngpus // 2): axis 0 splits the batch (policy 'data'), axis 1 as policy 'tp'."""
    mesh = (2, cfg.plan_ngpus // 2)
    data = pas_data(graph, ComputeConfig(mesh[0], mesh[0]))
    tp = pas_tp(graph, ComputeConfig(mesh[1], mesh[1]))
    nodes = {}
    for node in graph.nodes:
        d, t = data.node(node.name), tp.node(node.name)
        axis0 = (d.split, d.blocks) if d.is_split else (None, 1)
        axis1 = (t.split, t.blocks) if t.is_split else (None, 1)
        if axis0[0] is None and axis1[0] is None:
            nodes[node.name] = NodePlan()
            continue
        bound = annotate_node(node, graph)
        for cand in ((axis0, axis1), (axis0, (None, 1)), ((None, 1), axis1)):
            if cand[0][0] is not None and cand[0][0] == cand[1][0]:
                continue
            if cand[0][0] is None and cand[1][0] is None:
                continue
            if not isinstance(mesh_layouts_for(bound, get_rule(node.op), cand, mesh), str):
                nodes[node.name] = NodePlan(mesh_splits=cand)
                break
        else:
            nodes[node.name] = NodePlan()
    return Plan("data_x_tp", cfg.plan_ngpus, nodes, mesh=mesh)


class TokenFFN(nn.Module):
    """Two pre-norm feed-forward blocks over (batch, tokens, width): weights and activations of about the
    same size, where a 2-D split (batch x hidden) halves both collectives of 1-D data or tensor parallelism."""

    def __init__(self, width: int = 256, hidden: int = 1024, blocks: int = 2):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(blocks))
        self.ups = nn.ModuleList(nn.Linear(width, hidden) for _ in range(blocks))
        self.downs = nn.ModuleList(nn.Linear(hidden, width) for _ in range(blocks))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for norm, up, down in zip(self.norms, self.ups, self.downs):
            x = x + down(F.gelu(up(norm(x))))
        return F.mse_loss(x, y)


def build_token_ffn(seed: int = 0):
    torch.manual_seed(seed)
    model = TokenFFN()

    def make_batch(seed: int, batch_size: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return {
            "x": torch.randn(batch_size, 256, 256, generator=g),
            "y": torch.randn(batch_size, 256, 256, generator=g),
        }

    return model.train(), make_batch


SLOW_LINK_CLUSTER = {
    "name": "fast devices on a slow link (bandwidth-bound collectives)",
    "device": "cpu",
    "nodes": 1,
    "devices_per_node": 8,
    "intra_node": {"bandwidth_gbs": 1.0, "latency_us": 1},
    "inter_node": {"bandwidth_gbs": 0.5, "latency_us": 2},
}
"""A cluster where the cost of a collective is its bytes: 2-D splits pay off on TokenFFN."""


def two_stages_data_x_tp(graph: Graph, cfg: ComputeConfig) -> Plan:
    """Two pipeline stages (the second starts at the second transformer block), each a 2 x 2 mesh
    split as data_x_tp; plan_ngpus 8, end-to-end mode with pas_config['nmicros'] micro-batches."""
    from nnscaler.policies import PipelinePlan
    from nnscaler.policies.staging import pivot_starts

    inner = data_x_tp(graph, ComputeConfig(cfg.plan_ngpus // 2, cfg.plan_ngpus // 2))
    blocks = pivot_starts(graph, ("Block",))
    starts = (graph.nodes[0].name, graph.nodes[blocks[1][0]].name)
    staged = Plan(
        "two_stages_data_x_tp",
        cfg.plan_ngpus,
        inner.nodes,
        pipeline=PipelinePlan(starts, pp_size=2, nmicros=1),
        mesh=inner.mesh,
    )
    return cfg.apply_pipeline_scheduler(staged, 2, cfg.pas_config["nmicros"], "1f1b")
