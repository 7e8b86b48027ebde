"""Grouped-query attention keeps SDPA's `enable_gqa` (no repeated key/value heads) and tensor
parallelism splits it by kv-head group (issue 11)."""

from __future__ import annotations

import pytest

from nnscaler import ComputeConfig
from nnscaler.graph.capture import capture
from nnscaler.graph.ir import Shard
from nnscaler.graph.ops import annotate_node, get_rule, layouts_for
from nnscaler.parallel.compile import compile_module
from tests import models_gqa
from tests.parity import run_parity


def _sdpa(graph):
    return next(n for n in graph.nodes if n.op == "aten.scaled_dot_product_attention.default")


def test_grouped_split_keeps_whole_groups():
    model, make_batch = models_gqa.build()
    graph = capture(model, make_batch(0, 2))
    node = _sdpa(graph)
    bound = annotate_node(node, graph)
    # self-attention names the key sequence like the query one (`s`: context parallelism splits both)
    assert str(bound).startswith("_s0 (g 4) s^ d^, _s0 g s^ d^, _s0 g s^ e^")
    split = layouts_for(bound, get_rule(node.op), "g", 2)
    assert split.inputs == [Shard(1), Shard(1), Shard(1)] and split.outputs == [Shard(1)]
    assert isinstance(layouts_for(bound, get_rule(node.op), "g", 4), str)  # 2 groups do not split 4 ways


def test_tp_code_calls_sdpa_with_enable_gqa_on_local_groups(tmp_path):
    model, make_batch = models_gqa.build()
    compile_module(model, make_batch(0, 2), "tp", ComputeConfig(2, 2), tmp_path, "test")
    code = (tmp_path / "gencode0.py").read_text().splitlines()
    line = next(ln for ln in code if ln.strip().startswith("scaled_dot_product_attention = F."))
    assert "enable_gqa=True" in line
    assert "local [2, 4, 12, 4]" in line  # half of the 8 query heads: one kv group of 4 per rank


@pytest.mark.parametrize("policy, plan, runtime", [("tp", 2, 2), ("tp", 2, 4)])
def test_gqa_parity(policy, plan, runtime, tmp_path):
    run_parity(
        "tests.models_gqa:build",
        policy,
        plan,
        runtime,
        steps=2,
        tmp_path=tmp_path,
        optimizer="sgd",
        atol=1e-6,
        shapes=[(4, None), (2, 8)],
    )
