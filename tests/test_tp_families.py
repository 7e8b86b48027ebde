"""Tensor parallelism on Falcon (parallel attention and MLP; fused multi-query and grouped-KV q/k/v)
and on torch.nn.MultiheadAttention (packed in_proj_weight) trains exactly as on one device, with the
weights split.

All four models train two SGD steps under tp with ComputeConfig(2, 2) in one pair of processes; the
losses and every merged parameter are compared with one-device training (SGD: a wrong gradient moves
the parameters, DESIGN.md §4). Which weights are split, and the communication per layer, are checked
without processes in tests/compiler/test_policies.py. The op rules these plans rely on (a reshape
that regroups sub-dims, indexing with leading `None`s, attention with one shared K/V head) are
checked here on random inputs, split as the rules allow and merged, against the op computed whole.
"""

from __future__ import annotations

import pytest
import torch

from nnscaler.graph.ops import annotate_node, get_rule
from tests.compiler.op_fuzz_cases import Case
from tests.compiler.test_op_fuzz import _check_split, _one_node_graph, _splits, sim_dist  # noqa: F401
from tests.parity import ParityCase, run_parity_many

MODELS = ("falcon_mq", "falcon_gqa", "mha", "mha_seq_first")


@pytest.mark.slow
def test_tp_families_match_one_device(tmp_path):
    cases = [ParityCase(model, "tp", 2, optimizer="sgd") for model in MODELS]
    results = run_parity_many(cases, 2, tmp_path=tmp_path, timeout=280)
    for model, ranks in zip(MODELS, results):
        kept = max(r["local_param_fraction"] for r in ranks)
        # embeddings, heads, attention and MLP weights are halved; only norms (and, under multi-query
        # attention, nothing else) stay whole: a rank holds barely more than half of the model
        assert kept < 0.55, f"{model} under tp keeps {kept:.0%} of its parameters on each rank"


def _f(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(sum(shape)))


RULE_CASES = [
    # nn.MultiheadAttention: (seq, batch, heads * head_dim) -> (seq, batch * heads, head_dim)
    ("aten.view.default", Case((_f(6, 2, 12), [6, 8, 3]))),
    ("aten.view.default", Case((_f(6, 8, 3), [6, 2, 12]))),
    ("aten.view.default", Case((_f(2, 6, 4), [4, 12]))),
    ("aten.view.default", Case((_f(4, 6), [6, 4]))),  # no common sub-dims: whole
    # Falcon: qkv[:, :, :, [-2]] (a lifted index tensor), and indexing forms around it
    ("aten.index.Tensor", Case((_f(2, 6, 6, 4), [None, None, torch.tensor([4])]))),
    (
        "aten.index.Tensor",
        Case((_f(2, 6, 6, 4), [None, torch.tensor([[1, 2], [0, 3]]), torch.tensor([4, 1])])),
    ),
    ("aten.index.Tensor", Case((_f(2, 6, 6, 4), [None, torch.tensor([1, 2]), None, torch.tensor([0, 1])]))),
    ("aten.index.Tensor", Case((_f(6, 6), [torch.tensor(2)]))),
    # multi-query attention: one K/V head for every query head
    ("aten.scaled_dot_product_attention.default", Case((_f(2, 4, 6, 8), _f(2, 1, 6, 8), _f(2, 1, 6, 8)))),
    (
        "aten.scaled_dot_product_attention.default",
        Case((_f(2, 4, 6, 8), _f(2, 1, 6, 8), _f(2, 1, 6, 8), _f(2, 1, 6, 6))),
    ),
    (
        "aten.scaled_dot_product_attention.default",
        Case((_f(2, 4, 6, 8), _f(2, 1, 6, 8), _f(2, 1, 6, 8)), {"is_causal": True, "enable_gqa": True}),
    ),
]


@pytest.mark.parametrize(
    "op,case", RULE_CASES, ids=[f"{op.split('.')[1]}-{k}" for k, (op, _) in enumerate(RULE_CASES)]
)
def test_rules_for_tp_families(op, case, sim_dist):  # noqa: F811
    graph, inputs, whole = _one_node_graph(op, case)
    bound = annotate_node(graph.nodes[0], graph)
    failures = [
        problem
        for ident, ways, blocks in _splits(bound, get_rule(op))
        if (problem := _check_split(op, case, graph, inputs, whole, bound, ident, ways, blocks))
    ]
    assert not failures, f"{op} '{bound}':\n  " + "\n  ".join(failures)


def test_rules_split_what_tp_needs():
    """The splits the plans rely on are allowed: heads through the regrouping view, the non-indexed
    dims of an index, the query heads of multi-query attention."""
    expect = {0: "c", 4: "b", 8: "h"}  # case -> identifier that must be splittable 2 ways
    for k, ident in expect.items():
        op, case = RULE_CASES[k]
        graph, _, _ = _one_node_graph(op, case)
        bound = annotate_node(graph.nodes[0], graph)
        assert ident in [i for i, ways, _ in _splits(bound, get_rule(op)) if ways == 2], f"{op} '{bound}'"
