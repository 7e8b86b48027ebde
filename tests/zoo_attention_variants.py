"""Attention written by hand, for the attention-pattern pass (graph/capture/attention_pattern.py).

- `build_alibi`: BLOOM-style decoder: one fused QKV linear whose output is `(heads, 3, head_dim)` per
  token, `(batch*heads, seq, head_dim)` operands, scores from `alibi.baddbmm(q, k^T, beta=1,
  alpha=1/sqrt(d))` with an ALiBi bias `(batch*heads, 1, seq)` made in the forward, a causal mask by
  `masked_fill(..., -inf)`, softmax with a float32 cast, dropout (p=0) and `torch.bmm` with the values.
- `build_einsum_relpos`: attention written with `torch.einsum` ("bhqd,bhkd->bhqk", "bhqk,bhkd->bhqd"),
  the scale a division by a constant, a learned relative-position bias per head (a table indexed by
  the clamped distance key - query) added to the scores, and a causal mask by `torch.where`.

Both are tiny (a few thousand parameters), fp32, in train mode; `make_batch(seed, batch_size)` gives
token ids and labels of length SEQ (divisible by 4, as zigzag over 2 devices needs).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["build_alibi", "build_einsum_relpos", "build_hf_bloom", "SEQ"]

SEQ = 16
VOCAB = 32
WIDTH = 16
HEADS = 4
LAYERS = 2


def _tokens(seed: int, batch_size: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return {"input_ids": tokens[:, :-1].clone(), "labels": tokens[:, 1:].clone()}


def alibi_slopes(heads: int) -> torch.Tensor:
    """ALiBi's per-head slopes 2^(-8 i / heads) (heads a power of two)."""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)])


class AlibiAttention(nn.Module):
    """BLOOM's attention: fused QKV, (b*h, s, d) operands, baddbmm with the ALiBi bias, bmm."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.query_key_value = nn.Linear(width, 3 * width)
        self.dense = nn.Linear(width, width)
        self.attention_dropout = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor, alibi: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h, d = self.heads, self.head_dim
        fused = self.query_key_value(x).view(b, s, h, 3, d)
        q = fused[..., 0, :].transpose(1, 2).reshape(b * h, s, d)
        k = fused[..., 1, :].permute(0, 2, 3, 1).reshape(b * h, d, s)
        v = fused[..., 2, :].transpose(1, 2).reshape(b * h, s, d)
        scores = alibi.baddbmm(batch1=q, batch2=k, beta=1.0, alpha=1.0 / math.sqrt(d))
        scores = scores.view(b, h, s, s).masked_fill(causal, float("-inf"))
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(x.dtype)
        probs = self.attention_dropout(probs).view(b * h, s, s)
        ctx = torch.bmm(probs, v).view(b, h, s, d).permute(0, 2, 1, 3).reshape(b, s, h * d)
        return self.dense(ctx)


class EinsumAttention(nn.Module):
    """Attention written with einsum, a learned relative-position bias and a causal `where`."""

    def __init__(self, width: int, heads: int, max_distance: int = 8):
        super().__init__()
        self.heads, self.head_dim, self.max_distance = heads, width // heads, max_distance
        self.q = nn.Linear(width, width, bias=False)
        self.k = nn.Linear(width, width, bias=False)
        self.v = nn.Linear(width, width, bias=False)
        self.o = nn.Linear(width, width, bias=False)
        self.rel_bias = nn.Embedding(2 * max_distance + 1, heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h, d = self.heads, self.head_dim
        q = self.q(x).view(b, s, h, d).transpose(1, 2)
        k = self.k(x).view(b, s, h, d).transpose(1, 2)
        v = self.v(x).view(b, s, h, d).transpose(1, 2)
        pos = torch.arange(s, device=x.device)
        distance = (pos[None, :] - pos[:, None]).clamp(-self.max_distance, self.max_distance)
        bias = self.rel_bias(distance + self.max_distance).permute(2, 0, 1).unsqueeze(0)  # (1, h, s, s)
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(d) + bias
        causal = pos[None, :] <= pos[:, None]
        scores = torch.where(causal, scores, float("-inf"))
        probs = scores.softmax(dim=-1)
        ctx = torch.einsum("bhqk,bhkd->bhqd", probs, v)
        return self.o(ctx.transpose(1, 2).reshape(b, s, h * d))


class Block(nn.Module):
    def __init__(self, attention: nn.Module, width: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = attention
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), *extra)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Decoder(nn.Module):
    """Token embedding, LAYERS blocks, a final norm and an untied head; forward returns the LM loss."""

    def __init__(self, alibi: bool):
        super().__init__()
        self.alibi = alibi
        self.embed = nn.Embedding(VOCAB, WIDTH)
        make = (lambda: AlibiAttention(WIDTH, HEADS)) if alibi else (lambda: EinsumAttention(WIDTH, HEADS))
        self.blocks = nn.ModuleList(Block(make(), WIDTH) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.register_buffer("slopes", alibi_slopes(HEADS), persistent=False)

    def _alibi(self, b: int, s: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """BLOOM's (b*h, 1, s) bias slope * key position, and the causal mask (True = hidden)."""
        pos = torch.arange(s, device=device, dtype=torch.float32)
        alibi = (self.slopes[:, None] * pos[None, :]).expand(b, HEADS, s).reshape(b * HEADS, 1, s)
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1)
        return alibi, causal[None, None]

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        extra = self._alibi(*input_ids.shape, x.device) if self.alibi else ()
        for block in self.blocks:
            x = block(x, *extra)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def build_alibi(seed: int = 0):
    torch.manual_seed(seed)
    return Decoder(alibi=True).train(), _tokens


def build_einsum_relpos(seed: int = 0):
    torch.manual_seed(seed)
    return Decoder(alibi=False).train(), _tokens


def build_hf_bloom(seed: int = 0):
    """BLOOM from transformers, unmodified (its ALiBi attention is the `baddbmm` form), tiny sizes."""
    from transformers import BloomConfig, BloomForCausalLM

    config = BloomConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        n_layer=LAYERS,
        n_head=HEADS,
        use_cache=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = BloomForCausalLM(config).train()

    def make_batch(seed: int, batch_size: int) -> dict:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}

    return model, make_batch


def _hf_eager(config_name: str, model_name: str, decoder_ids: bool = False, **sizes):
    import transformers

    config = getattr(transformers, config_name)(
        vocab_size=VOCAB, use_cache=False, tie_word_embeddings=False, **sizes
    )
    config._attn_implementation = "eager"

    def build(seed: int = 0):
        torch.manual_seed(seed)
        model = getattr(transformers, model_name)(config).train()

        def make_batch(seed: int, batch_size: int) -> dict:
            g = torch.Generator().manual_seed(seed)
            ids = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
            batch = {"input_ids": ids, "labels": ids.clone()}
            return {**batch, "decoder_input_ids": ids.clone()} if decoder_ids else batch

        return model, make_batch

    return build


build_hf_gpt2_eager = _hf_eager(
    "GPT2Config",
    "GPT2LMHeadModel",
    n_embd=WIDTH,
    n_layer=LAYERS,
    n_head=HEADS,
    attn_pdrop=0.0,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    n_positions=4 * SEQ,
)
"""GPT-2 from transformers with eager attention (matmul, division, causal `where`, softmax, matmul)."""

build_hf_llama_eager = _hf_eager(
    "LlamaConfig",
    "LlamaForCausalLM",
    hidden_size=WIDTH,
    intermediate_size=2 * WIDTH,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=2,
)
"""Llama from transformers with eager attention (grouped-query heads repeated, an additive causal mask)."""


class SharedBiasAttention(nn.Module):
    """matmul attention plus a learned bias read whole by a split: `shared` (s, s), the same for every
    head (whole under tp), or `per_key` (heads, 1, s), one row for every query (whole under cp); or,
    `causal`, no bias and a causal mask by `masked_fill(~tril, -inf)`; or `bshd`, that with einsum over
    (b, s, h, d) tensors ('bqhd,bkhd->bhqk', 'bhqk,bkhd->bqhd')."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.o = nn.Linear(WIDTH, WIDTH, bias=False)
        self.shared = nn.Parameter(torch.randn(SEQ, SEQ) * 0.1)
        self.per_key = nn.Parameter(torch.randn(HEADS, 1, SEQ) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        if self.kind == "bshd":  # einsum straight over (b, s, h, d) tensors; causal by tril
            q, k, v = self.qkv(x).view(b, s, 3, HEADS, WIDTH // HEADS).unbind(2)
            scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * (WIDTH // HEADS) ** -0.5
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
            return self.o(torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, WIDTH))
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(WIDTH // HEADS)
        if self.kind == "causal":  # no bias: the mask alone, which capture makes is_causal=True
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
        else:
            scores = scores + (self.shared[:s, :s] if self.kind == "shared" else self.per_key[..., :s])
        return self.o(torch.matmul(scores.softmax(-1), v).transpose(1, 2).reshape(b, s, WIDTH))


class _BiasDecoder(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.embed, self.attn, self.head = (
            nn.Embedding(VOCAB, WIDTH),
            SharedBiasAttention(kind),
            nn.Linear(WIDTH, VOCAB),
        )

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        x = x + self.attn(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def build_shared_bias(seed: int = 0):
    torch.manual_seed(seed)
    return _BiasDecoder("shared").train(), _tokens


def build_per_key_bias(seed: int = 0):
    torch.manual_seed(seed)
    return _BiasDecoder("per_key").train(), _tokens


def build_causal_matmul(seed: int = 0):
    torch.manual_seed(seed)
    return _BiasDecoder("causal").train(), _tokens


def build_einsum_bshd(seed: int = 0):
    torch.manual_seed(seed)
    return _BiasDecoder("bshd").train(), _tokens


build_hf_bert_eager = _hf_eager(
    "BertConfig",
    "BertForMaskedLM",
    hidden_size=WIDTH,
    intermediate_size=2 * WIDTH,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
"""BERT from transformers with eager attention (a separate key projection with a bias, whose gradient is
round-off only: compile-time verify compares it at the scale of the model's gradients)."""

build_hf_t5_eager = _hf_eager(
    "T5Config",
    "T5ForConditionalGeneration",
    decoder_ids=True,
    d_model=WIDTH,
    d_kv=WIDTH // HEADS,
    d_ff=2 * WIDTH,
    num_layers=LAYERS,
    num_heads=HEADS,
    dropout_rate=0.0,
)
"""T5 from transformers with eager attention: a learned relative-position bias, no scale, cross-attention."""
