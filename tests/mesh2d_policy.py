"""A 2-D policy for tests: the batch over mesh axis 0 and Megatron's split over axis 1, per node.

Written from the two 1-D policies so the parity tests exercise 2-D splits on every zoo op they reach,
not just the ones a search happens to pick."""

from __future__ import annotations

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
