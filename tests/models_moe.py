"""Tiny mixture-of-experts models for the expert-parallel tests (tests/test_moe_*.py): Mixtral,
Qwen2-MoE (a gated shared expert), DeepSeek-V3 (shared experts, group-limited routing), and a
hand-written block (router, load-balancing and z losses, a shared expert, experts written as a dense
loop). Each has >= 4 experts and top-2 routing. `*_aux` variants add the router's auxiliary loss to
the loss (exact only without data-parallel replicas: the loss is not linear in the batch; the
transformers ones set output_router_logits=True);
`*_capacity` ones run their experts with a capacity factor that drops assignments, on one device too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.zoo import _settle, _settle_model, _token_batch

VOCAB, SEQ = 128, 16
CAPACITY_FACTOR = 0.75
"""Drops some assignments of the tiny models' batches (tests check that it does)."""


def _hf(config_cls, model_cls, seed: int, **extra: Any):
    config = config_cls(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        **extra,
    )
    _settle(config)
    torch.manual_seed(seed)
    model = _settle_model(model_cls(config))
    return model, _token_batch(VOCAB, SEQ, "input_ids", "labels", shift=False)


def build_mixtral(seed: int = 0, aux: bool = False):
    from transformers import MixtralConfig, MixtralForCausalLM

    return _hf(
        MixtralConfig,
        MixtralForCausalLM,
        seed,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=None,
        router_jitter_noise=0.0,
        output_router_logits=aux,
        router_aux_loss_coef=0.02,
    )


def build_mixtral_aux(seed: int = 0):
    return build_mixtral(seed, aux=True)


def build_qwen2_moe(seed: int = 0, aux: bool = False):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return _hf(
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        seed,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        norm_topk_prob=True,
        output_router_logits=aux,
        router_aux_loss_coef=0.02,
    )


def build_qwen2_moe_aux(seed: int = 0):
    return build_qwen2_moe(seed, aux=True)


def build_deepseek_v3(seed: int = 0):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    model, batch = _hf(
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        seed,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        rope_scaling=None,
    )
    with torch.no_grad():  # a router HF initialises to zeros would tie every score
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(seed + 1))
    return model, batch


# ---------------------------------------------------------------------------------------------
# a hand-written block
# ---------------------------------------------------------------------------------------------
class DenseLoopExperts(nn.Module):
    """Experts in the fused layout, computed densely: every expert on every token, weighted by a
    [T, E] gate that is zero except at the token's chosen experts."""

    def __init__(self, experts: int, hidden: int, inner: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inner, hidden) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, inner) * 0.1)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        experts = self.gate_up_proj.shape[0]
        chosen = top_k_index.unsqueeze(-1) == torch.arange(experts, device=top_k_index.device)
        dense = (chosen * top_k_weights.unsqueeze(-1)).sum(dim=1)  # [T, E]
        out = torch.zeros_like(hidden_states)
        for e in range(experts):
            gate, up = (hidden_states @ self.gate_up_proj[e].t()).chunk(2, dim=-1)
            out = out + dense[:, e : e + 1] * ((self.act_fn(gate) * up) @ self.down_proj[e].t())
        return out


class HandMoE(nn.Module):
    """Softmax top-k router, Switch load-balancing loss and router z-loss, a dense shared expert."""

    def __init__(self, hidden: int, experts: int, topk: int, inner: int):
        super().__init__()
        self.topk, self.experts_n = topk, experts
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = DenseLoopExperts(experts, hidden, inner)
        self.shared = nn.Sequential(nn.Linear(hidden, inner), nn.GELU(), nn.Linear(inner, hidden))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.reshape(-1, x.shape[-1])
        logits = self.router(flat)
        probs = logits.softmax(dim=-1)
        weights, index = probs.topk(self.topk, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.experts(flat, index, weights) + self.shared(flat)
        chosen = (index.unsqueeze(-1) == torch.arange(self.experts_n, device=x.device)).float().sum(dim=1)
        balance = self.experts_n * (chosen.mean(dim=0) / self.topk * probs.mean(dim=0)).sum()
        z = torch.logsumexp(logits, dim=-1).pow(2).mean()
        return out.reshape(x.shape), 0.01 * balance + 0.001 * z


class HandModel(nn.Module):
    """Embedding, two pre-norm MoE blocks, LM head; loss = cross entropy (+ router losses)."""

    def __init__(self, aux: bool):
        super().__init__()
        self.aux = aux
        self.embed = nn.Embedding(VOCAB, 64)
        self.norms = nn.ModuleList(nn.LayerNorm(64) for _ in range(2))
        self.blocks = nn.ModuleList(HandMoE(64, 4, 2, 32) for _ in range(2))
        self.head = nn.Linear(64, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        router_loss = h.new_zeros(())
        for norm, block in zip(self.norms, self.blocks):
            out, extra = block(norm(h))
            h = h + out
            router_loss = router_loss + extra
        loss = nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())
        return loss + router_loss if self.aux else loss


def build_hand(seed: int = 0, aux: bool = False):
    torch.manual_seed(seed)
    return HandModel(aux).float().train(), _token_batch(VOCAB, SEQ, "input_ids", "labels", shift=True)


def build_hand_aux(seed: int = 0):
    return build_hand(seed, aux=True)


def _with_capacity(built):
    from nnscaler.graph.capture.moe import use_moe_op

    model, batch = built
    assert use_moe_op(model, capacity_factor=CAPACITY_FACTOR), "no experts module recognised"
    return model, batch


def build_mixtral_capacity(seed: int = 0):
    return _with_capacity(build_mixtral(seed))


def build_hand_capacity(seed: int = 0):
    return _with_capacity(build_hand(seed, aux=True))
