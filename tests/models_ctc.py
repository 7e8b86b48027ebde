"""A small speech CTC model written for the value-check tests (issue 40), with the label-range check
its top forward makes before the loss:

    if labels.max() >= self.vocab_size:
        raise ValueError(f"labels must be < {self.vocab_size} ...")

Log-mel-like features (batch, frames, mels) -> a Conv1d (or, `build_speech_ctc_linear`, a per-frame
Linear) + Linear frontend -> two transformer
encoder layers (F.scaled_dot_product_attention, bidirectional) -> a linear CTC head -> F.ctc_loss
(blank 0) over every frame. About 5k parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MELS, FRAMES, TARGET, VOCAB, DIM, HEADS = 8, 16, 5, 12, 16, 2


class EncoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class SpeechCTC(nn.Module):
    """forward(features, labels) -> mean CTC loss; labels are 1..vocab_size-1 (0 is the blank)."""

    def __init__(
        self, mels: int = MELS, dim: int = DIM, heads: int = HEADS, vocab_size: int = VOCAB, conv: bool = True
    ):
        super().__init__()
        self.vocab_size = vocab_size
        # a convolution over time needs neighbouring frames (context parallelism cannot split it)
        self.conv = nn.Conv1d(mels, dim, kernel_size=3, padding=1) if conv else nn.Linear(mels, dim)
        self.inp = nn.Linear(dim, dim)
        self.layers = nn.ModuleList([EncoderLayer(dim, heads) for _ in range(2)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if labels.max() >= self.vocab_size:
            raise ValueError(f"labels must be < {self.vocab_size} (the CTC head's vocabulary)")
        if isinstance(self.conv, nn.Conv1d):
            x = F.gelu(self.conv(features.transpose(1, 2))).transpose(1, 2)
        else:
            x = F.gelu(self.conv(features))
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        log_probs = F.log_softmax(self.head(self.norm(x)), dim=-1)
        b, t = log_probs.shape[0], log_probs.shape[1]
        input_lengths = torch.full((b,), t, dtype=torch.long, device=features.device)
        target_lengths = torch.full((b,), labels.shape[1], dtype=torch.long, device=features.device)
        return F.ctc_loss(log_probs.transpose(0, 1), labels, input_lengths, target_lengths, blank=0)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_batch(seed: int, batch_size: int) -> dict[str, torch.Tensor]:
    g = _gen(seed)
    features = torch.randn(batch_size, FRAMES, MELS, generator=g)
    labels = torch.randint(1, VOCAB, (batch_size, TARGET), generator=g)
    return {"features": features, "labels": labels}


def build_speech_ctc(seed: int = 0):
    torch.manual_seed(seed)
    return SpeechCTC().train(), make_batch


def build_speech_ctc_linear(seed: int = 0):
    """The same model with a per-frame linear frontend instead of the convolution over time: its
    sequence can be split from the input on (context parallelism)."""
    torch.manual_seed(seed)
    return SpeechCTC(conv=False).train(), make_batch


def bad_batch(seed: int, batch_size: int) -> dict[str, torch.Tensor]:
    """A batch with one label out of the vocabulary (the model's check raises on it)."""
    batch = make_batch(seed, batch_size)
    batch["labels"][-1, 0] = VOCAB + 3
    return batch
