"""The attention-pattern pass (graph/capture/attention_fuse.py): hand-written attention becomes one
scaled_dot_product_attention node at the user's line, and near misses are left as they are."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nnscaler.config import ComputeConfig
from nnscaler.graph.capture import capture
from nnscaler.graph.ir import verify
from nnscaler.partition import apply_plan
from nnscaler.policies.context_parallel import attention_nodes
from nnscaler.policies.tp import pas_tp
from tests import zoo_attention_variants as variants

SDPA = "aten.scaled_dot_product_attention.default"
HAND_OPS = ("aten.bmm.default", "aten.baddbmm.default", "aten.einsum.default", "aten.softmax.int")


@pytest.fixture(scope="module")
def alibi():
    model, make_batch = variants.build_alibi()
    return capture(model, make_batch(0, 2))


@pytest.fixture(scope="module")
def einsum():
    model, make_batch = variants.build_einsum_relpos()
    return capture(model, make_batch(0, 2))


def _ops(graph) -> list[str]:
    return [n.op for n in graph.nodes]


@pytest.mark.parametrize(
    "name, line", [("alibi", "alibi.baddbmm("), ("einsum", 'torch.einsum("bhqd,bhkd->bhqk"')]
)
def test_pass_makes_one_sdpa_per_layer_at_the_user_line(name, line, request):
    graph = request.getfixturevalue(name)
    verify(graph)
    attention = [n for n in graph.nodes if n.op == SDPA]
    assert len(attention) == variants.LAYERS
    assert not any(op in HAND_OPS for op in _ops(graph))
    for k, node in enumerate(attention):
        assert line in node.source and f"blocks.{k}.attn" == node.module_path
        q, key, v, mask = (graph.values[r].meta for r in node.input_names())
        assert (
            q.shape
            == key.shape
            == v.shape
            == (2, variants.HEADS, variants.SEQ, variants.WIDTH // variants.HEADS)
        )
        assert mask.dtype == "float32" and mask.shape[-1] == variants.SEQ
        assert node.kwargs["scale"] == pytest.approx(1 / math.sqrt(variants.WIDTH // variants.HEADS))


def test_learned_bias_keeps_its_gradient_path(einsum):
    (node, *_) = [n for n in einsum.nodes if n.op == SDPA]
    assert einsum.values[node.input_names()[3]].meta.requires_grad  # the relative-position table trains


def test_tp_splits_heads_and_cp_splits_the_sequence(alibi, einsum):
    for graph in (alibi, einsum):
        plan = pas_tp(graph, ComputeConfig(2, 2))
        for node in (n for n in graph.nodes if n.op == SDPA):
            assert plan.node(node.name).split == "h"
        assert len(attention_nodes(graph)) == variants.LAYERS
        for kind, cp in (("zigzag", 2), ("ring", 2), ("ulysses", 2), ("hybrid", 4)):
            plan = pas_tp(graph, ComputeConfig(cp, cp, pas_config={"cp_size": cp, "cp_kind": kind}))
            for node in attention_nodes(graph):
                assert plan.node(node.name).split == "s", kind
            calls = [s for s in apply_plan(graph, plan).statements if "context_parallel_attention" in s.op]
            assert len(calls) == variants.LAYERS and all(c.kwargs["kind"] == kind for c in calls)


class _Attention(nn.Module):
    """q k^T / sqrt(d), a causal mask, softmax, dropout, @ v; `variant` makes one near miss."""

    def __init__(self, variant: str = "", p: float = 0.0):
        super().__init__()
        self.variant = variant
        self.proj = nn.Linear(8, 24)
        self.temperature = nn.Parameter(torch.tensor(0.5))
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.proj(x).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-1, -2))
        scores = scores * self.temperature if self.variant == "param_scale" else scores / 2.0
        causal = torch.ones(s, s, dtype=torch.bool).tril(-1 if self.variant == "no_diagonal" else 0)
        if self.variant == "shifted":  # a window: key <= query and key > query - 3
            causal = causal & ~torch.ones(s, s, dtype=torch.bool).tril(-3)
        scores = scores.masked_fill(~causal, float("-inf") if self.variant != "fill_zero" else 0.0)
        if self.variant == "upcast":  # half scores, softmax in float32, cast back (BLOOM, GPT-2)
            probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
        elif self.variant == "upcast_kept":  # float32 probabilities against half values: not fused
            probs = F.softmax(scores, dim=-1, dtype=torch.float32)
            v = v.float()
        else:
            probs = scores.softmax(dim=-2 if self.variant == "softmax_rows" else -1)
        probs = self.drop(probs)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, 8)
        if self.variant == "probs_returned":
            return out.sum() + probs.sum()
        return out.sum()


def _capture(module: nn.Module, dtype: torch.dtype = torch.float32, **kw):
    return capture(module.to(dtype), {"x": torch.randn(2, 6, 8, dtype=dtype)}, **kw)


def test_plain_matmul_attention_fuses():
    graph = _capture(_Attention())
    assert _ops(graph).count(SDPA) == 1 and "aten.softmax.int" not in _ops(graph)
    (node,) = [n for n in graph.nodes if n.op == SDPA]
    assert len(node.input_names()) == 3 and node.kwargs["is_causal"] is True  # no (s, s) mask made
    assert node.kwargs["scale"] == 0.5
    assert "aten.tril.default" not in _ops(graph)


@pytest.mark.parametrize("variant", ["no_diagonal", "shifted"])
def test_a_mask_not_exactly_causal_stays_a_mask(variant):
    graph = _capture(_Attention(variant))
    (node,) = [n for n in graph.nodes if n.op == SDPA]
    assert "is_causal" not in node.kwargs
    assert graph.values[node.input_names()[3]].meta.dtype == "bool"  # a -inf mask alone stays boolean


def test_causal_by_comparing_positions():
    """einsum attention with the mask `where(pos[None, :] <= pos[:, None], scores, -inf)`."""

    class Causal(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 24)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape
            q, k, v = self.proj(x).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4)
            pos = torch.arange(s)
            scores = torch.where(
                pos[None, :] <= pos[:, None], torch.einsum("bhqd,bhkd->bhqk", q, k), float("-inf")
            )
            return torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), v).sum()

    graph = _capture(Causal())
    (node,) = [n for n in graph.nodes if n.op == SDPA]
    assert node.kwargs["is_causal"] is True and node.kwargs["scale"] == 1.0


def test_softmax_in_float32_cast_back_fuses():
    graph = _capture(_Attention("upcast"), torch.bfloat16)
    assert _ops(graph).count(SDPA) == 1


@pytest.mark.parametrize(
    "variant", ["softmax_rows", "param_scale", "fill_zero", "probs_returned", "upcast_kept"]
)
def test_near_misses_are_left_alone(variant):
    graph = _capture(_Attention(variant), torch.bfloat16 if variant == "upcast_kept" else torch.float32)
    assert SDPA not in _ops(graph), variant
    assert "aten.softmax.int" in _ops(graph)


def test_dropout_is_fused_only_where_it_draws_nothing():
    assert SDPA not in _ops(_capture(_Attention(p=0.1)))  # train mode: other random numbers if fused
    assert _ops(_capture(_Attention(p=0.1).eval(), both_modes=False)).count(SDPA) == 1


def _eager(family: str) -> nn.Module:
    import transformers

    sizes = {
        "gpt2": dict(n_embd=16, n_layer=2, n_head=4, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0),
        "llama": dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
    }[family]
    config_cls, model_cls = {
        "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[family]
    config = config_cls(vocab_size=32, use_cache=False, **sizes)
    config._attn_implementation = "eager"
    return model_cls(config).train()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_transformers_eager_attention_fuses(family):
    """GPT-2 (division by a constant, causal `where` with the dtype's min, upcast-free softmax) and Llama
    (grouped-query heads repeated, scale by multiplication, additive causal mask) in eager mode."""
    ids = torch.randint(0, 32, (2, 8))
    graph = capture(_eager(family), {"input_ids": ids, "labels": ids.clone()}, both_modes=False)
    assert _ops(graph).count(SDPA) == 2
    assert "aten.softmax.int" not in _ops(graph) and "aten._softmax.default" not in _ops(graph)


def test_einsum_over_bshd_operands_is_permuted():
    model, make_batch = variants.build_einsum_bshd()
    graph = capture(model, make_batch(0, 2))
    verify(graph)
    (node,) = [n for n in graph.nodes if n.op == SDPA]
    assert node.kwargs["is_causal"] is True and "aten.einsum.default" not in _ops(graph)
    q = graph.values[node.input_names()[0]].meta.shape
    assert q == (2, variants.HEADS, variants.SEQ, variants.WIDTH // variants.HEADS)
    (out,) = [n for n in graph.nodes if node.outputs[0] in n.input_names()]
    assert out.op == "aten.permute.default" and list(out.args[1]) == [0, 2, 1, 3]  # back to (b, s, h, d)
