"""Model coverage (issue 3): every op of the zoo annotated and shape-checked; tp splits the FLOPs."""

from __future__ import annotations

from collections import Counter

import pytest

from nnscaler import ComputeConfig
from nnscaler.graph.capture import capture
from nnscaler.graph.ops import annotate_node, get_rule
from nnscaler.partition import apply_plan
from nnscaler.policies import make_plan
from tests import zoo

ALL = ["mlp", "gpt", "llama", "gpt2", "mistral", "bert", "mixtral", "vit", "cnn"]


@pytest.fixture(scope="module")
def graphs():
    out = {}
    for name in ALL:
        model, make_batch = zoo.build(name)
        out[name] = capture(model, make_batch(7, 4))
    return out


def _matmul_flops(graph, node) -> int:
    """Multiply-adds of a linear-family op: the product of its annotation's identifier sizes."""
    bound = annotate_node(node, graph)
    flops = 1
    for ident in bound.anno.identifiers():
        if not ident.isdigit():
            flops *= bound.sizes[ident]
    return flops


@pytest.mark.parametrize("name", ALL)
def test_every_node_annotated_with_matching_shapes(graphs, name):
    """annotate_node binds each annotation to the traced shapes and checks the outputs it infers."""
    graph = graphs[name]
    missing = sorted({n.op for n in graph.nodes if annotate_node(n, graph) is None})
    assert not missing, f"{name}: ops without annotation: {missing}"


@pytest.mark.parametrize("name", ALL)
def test_tp_splits_at_least_90_percent_of_matmul_flops(graphs, name):
    graph = graphs[name]
    plan = make_plan(graph, "tp", ComputeConfig(2, 2))
    total = split = 0
    for node in graph.nodes:
        rule = get_rule(node.op)
        if rule is None or rule.family not in ("linear", "moe"):
            continue
        flops = _matmul_flops(graph, node)
        total += flops
        if plan.node(node.name).split is not None:
            split += flops
    assert total > 0
    assert split / total >= 0.9, f"{name}: only {split / total:.1%} of linear/matmul FLOPs split"


BLOCKS = {
    "mistral": "model.layers.1",
    "mixtral": "model.layers.1",
    "bert": "bert.encoder.layer.1",
    "vit": "vit.layers.1",
}


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_collectives_per_block_are_megatron_style(graphs, name):
    """Forward: one all-reduce after attention, one after the MLP (or MoE); backward: two more (f)."""
    graph = graphs[name]
    program = apply_plan(graph, make_plan(graph, "tp", ComputeConfig(2, 2)))
    block = BLOCKS[name]
    comms = Counter(
        s.op
        for s in program.statements
        if s.kind == "comm" and (s.module_path == block or s.module_path.startswith(block + "."))
    )
    want = Counter({"reduce_from_group": 2, "copy_to_group": 2})
    if name == "mixtral":  # the experts op reads the router weights whole: their gradient is summed too (f)
        want["copy_to_group"] += 1
    assert comms == want, comms


def test_mixtral_expert_weights_are_stored_sharded(graphs):
    graph = graphs["mixtral"]
    program = apply_plan(graph, make_plan(graph, "tp", ComputeConfig(2, 2)))
    layouts = {t.original_name: t.layout for t in program.tensors}
    assert str(layouts["model.layers.0.mlp.experts.gate_up_proj"]).startswith("S(1")
    assert str(layouts["model.layers.0.mlp.experts.down_proj"]).startswith("S(2")
    assert not any(s.op == "split_to_group" for s in program.statements), "weights sliced at run time"
