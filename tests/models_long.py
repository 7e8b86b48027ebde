"""Long-sequence models for context-parallel tests (sequence >= 1,024, small widths so CPU steps are quick).

- `build_llama_long`: Hugging Face Llama (RoPE from positions made inside the model, grouped-query
  attention, SDPA with is_causal), sequence 1,024.
- `build_gpt_long`: the nanoGPT example model (learned position embeddings, LayerNorm, GELU, multi-head
  attention with is_causal), sequence 1,024.
- `build_packed_long`: a decoder written here for packed sequences: documents restart their
  `position_ids` at 0; attention is causal inside each document and blind across documents (a boolean
  mask made in the forward from the position ids), RoPE follows the per-document positions.
- `build_chunked_loss_long`: Llama-like decoder whose LM head and loss run through
  `nnscaler.chunk_linear_cross_entropy` (logits never whole).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SEQ = 1024


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tokens(vocab: int, seq: int, input_key: str, label_key: str, shift: bool):
    def make_batch(seed: int, batch_size: int, seq_len: int | None = None) -> dict:
        n = seq_len or seq
        tokens = torch.randint(0, vocab, (batch_size, n + 1), generator=_gen(seed))
        if shift:
            return {input_key: tokens[:, :-1].clone(), label_key: tokens[:, 1:].clone()}
        return {input_key: tokens[:, :-1].clone(), label_key: tokens[:, :-1].clone()}

    return make_batch


def build_llama_long(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.zoo import _settle, _settle_model

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4 * SEQ,
        use_cache=False,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    _settle(config)
    torch.manual_seed(seed)
    model = _settle_model(LlamaForCausalLM(config))
    return model, _tokens(config.vocab_size, SEQ, "input_ids", "labels", shift=False)


def build_gpt_long(seed: int = 0):
    from examples.nanogpt.model import GPT, GPTConfig

    config = GPTConfig(
        block_size=4 * SEQ, vocab_size=64, n_layer=2, n_head=4, n_embd=32, dropout=0.0, bias=True
    )
    torch.manual_seed(seed)
    return GPT(config).train(), _tokens(config.vocab_size, SEQ, "idx", "targets", shift=True)


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (b, h, s, d) at integer positions (b, s)."""
    half = x.shape[-1] // 2
    freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    angle = positions.to(torch.float32)[:, None, :, None] * freq
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class PackedBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        q, k = _rope(q, positions), _rope(k, positions)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class PackedLM(nn.Module):
    """Packed documents: `position_ids` restart at 0 where a document starts."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(PackedBlock(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        doc = (position_ids == 0).cumsum(-1)  # document index of every token
        s = input_ids.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool, device=input_ids.device).tril()
        mask = ((doc[:, :, None] == doc[:, None, :]) & causal).unsqueeze(1)
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, position_ids, mask)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))


def _packed_positions(batch: int, seq: int, seed: int) -> torch.Tensor:
    """Document lengths drawn at random (uneven, some cross chunk boundaries)."""
    g = _gen(seed + 7)
    rows = []
    for _ in range(batch):
        pos, left = [], seq
        while left:
            n = min(left, int(torch.randint(1, max(2, seq // 3), (1,), generator=g)))
            pos += list(range(n))
            left -= n
        rows.append(pos)
    return torch.tensor(rows)


def build_packed_long(seed: int = 0):
    torch.manual_seed(seed)
    model = PackedLM().train()

    def make_batch(batch_seed: int, batch_size: int, seq_len: int | None = None) -> dict:
        n = seq_len or SEQ
        tokens = torch.randint(0, 64, (batch_size, n + 1), generator=_gen(batch_seed))
        return {
            "input_ids": tokens[:, :-1].clone(),
            "position_ids": _packed_positions(batch_size, n, batch_seed),
            "labels": tokens[:, 1:].clone(),
        }

    return model, make_batch


class ChunkedLossLM(nn.Module):
    """A decoder whose loss is nnscaler.chunk_linear_cross_entropy (per-token losses, mean over tokens)."""

    def __init__(self, vocab: int = 256, dim: int = 32, heads: int = 4, layers: int = 2, chunk: int = 256):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(PackedBlock(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.chunk = chunk

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        import nnscaler

        s = input_ids.shape[1]
        positions = torch.arange(s, device=input_ids.device).expand_as(input_ids)
        mask = torch.ones(s, s, dtype=torch.bool, device=input_ids.device).tril()
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, positions, mask)
        hidden = self.norm(x).reshape(-1, x.shape[-1])
        losses = nnscaler.chunk_linear_cross_entropy(
            hidden, self.head.weight, labels.reshape(-1), chunk_size=self.chunk
        )
        return losses.mean()


def build_chunked_loss_long(seed: int = 0):
    torch.manual_seed(seed)
    return ChunkedLossLM().train(), _tokens(256, SEQ, "input_ids", "labels", shift=True)
