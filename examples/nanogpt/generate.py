"""Text from the example's GPT: merge a parallel module's weights into a plain GPT on rank 0, sample.

`GPT.forward` returns the loss only (that is what nnscaler traces), so `logits` runs the same
layers up to the head; `generate` samples from it one character at a time (top-k, temperature).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from examples.nanogpt.model import GPT, GPTConfig
from nnscaler import merge_state_dicts

__all__ = ["merged_gpt", "logits", "generate", "get_batch", "eval_loss"]


def _cpu(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def merged_gpt(parallel_module: Any, config: GPTConfig) -> GPT | None:
    """A single-device GPT(config) holding the trained weights, on rank 0 (None elsewhere). Collective:
    every rank calls it; each sends its state dict to rank 0, which merges them (`merge_state_dicts`)."""
    state = _cpu(parallel_module.state_dict())
    if not (dist.is_available() and dist.is_initialized()):
        pieces = [state]
    else:
        pieces = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(state, pieces, dst=0)
        if dist.get_rank() != 0:
            return None
    merged, _ = merge_state_dicts(pieces)
    model = GPT(config)
    model.load_state_dict(merged)
    return model.eval()


def logits(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """(B, T, vocab) next-token logits of a plain GPT: its forward without the loss."""
    t = model.transformer
    pos = torch.arange(idx.size(1), device=idx.device)
    x = t.drop(t.wte(idx) + t.wpe(pos))
    for block in t.h:
        x = block(x)
    return model.lm_head(t.ln_f(x))


@torch.no_grad()
def generate(
    model: GPT,
    prompt: list[int],
    max_new_tokens: int,
    top_k: int = 10,
    temperature: float = 0.8,
    seed: int = 0,
) -> list[int]:
    """`prompt` followed by `max_new_tokens` sampled ids (top_k=1: greedy)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.tensor([prompt], dtype=torch.long)
    for _ in range(max_new_tokens):
        out = logits(model, idx[:, -model.config.block_size :])[0, -1] / max(temperature, 1e-6)
        top, where = torch.topk(out, min(top_k, out.numel()))
        pick = where[torch.multinomial(F.softmax(top, dim=-1), 1, generator=g)]
        idx = torch.cat([idx, pick.view(1, 1)], dim=1)
    return idx[0].tolist()


def get_batch(
    data: np.ndarray, block: int, batch: int, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` random windows of `block` ids and their next-id targets (nanoGPT's get_batch)."""
    ix = torch.randint(len(data) - block - 1, (batch,), generator=g).tolist()
    x = torch.stack([torch.from_numpy(data[i : i + block].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + block].astype(np.int64)) for i in ix])
    return x, y


@torch.no_grad()
def eval_loss(model: GPT, data: np.ndarray, block: int, batch: int, iters: int, seed: int = 1234) -> float:
    """Mean loss of a plain GPT over `iters` fixed random batches of `data`."""
    was_training = model.training
    model.eval()
    g = torch.Generator().manual_seed(seed)
    loss = sum(model(*get_batch(data, block, batch, g)).item() for _ in range(iters)) / iters
    model.train(was_training)
    return loss
