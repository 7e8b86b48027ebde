"""The experts of a mixture-of-experts layer on one device: tokens sorted by expert, one matmul per
expert (grouped GEMM), the results weighted by the router and summed per token.

Layout of the weights (transformers' fused experts): `gate_up [E, 2I, H]` (gate rows, then up rows),
`down [E, H, I]`; expert e computes `down[e] @ (act(gate) * up)` of `gate_up[e] @ x`.

Capacity (optional): expert e keeps the first `capacity(T, K, E, factor)` of its (token, slot)
assignments in token order (T: tokens of the whole group, K: experts per token); the others add
nothing to their token. The same rule runs on one device and under expert parallelism.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["ACTIVATIONS", "capacity", "expert_ffn", "sort_by_expert", "combine", "local_experts"]

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
"""Activations of the experts' gate, by the name the op takes."""


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"moe experts: unknown activation {name!r}; known: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def capacity(tokens: int, topk: int, experts: int, factor: float) -> int:
    """Assignments one expert keeps: ceil(factor * tokens * topk / experts)."""
    if factor <= 0:
        raise ValueError(f"moe capacity_factor must be > 0 (None: dropless), got {factor}")
    return math.ceil(factor * tokens * topk / experts)


def _grouped_available(x: torch.Tensor) -> bool:
    return hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16


def _grouped(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """x [N, in] sorted by expert, w [E, out, in] -> [N, out]: x rows of expert e times w[e].T."""
    if _grouped_available(x) and x.shape[0] > 0:
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    pieces = [torch.mm(part, w[e].t()) for e, part in enumerate(torch.split(x, counts, dim=0)) if counts[e]]
    # no rows at all: still a product of x and w (empty), so that autograd runs every rank's backward
    # collectives alike and the weights get a (zero) gradient
    return torch.cat(pieces, dim=0) if pieces else torch.mm(x, w[0].t())


def expert_ffn(
    x: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor, act: str
) -> torch.Tensor:
    """Every expert's gated MLP on its rows of `x` (sorted by expert; `counts` rows each)."""
    h = _grouped(x, gate_up, counts)
    gate, up = h.chunk(2, dim=-1)
    return _grouped(activation(act)(gate) * up, down, counts)


def sort_by_expert(top_k_index: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts): the (token, slot) assignments sorted by expert, token order kept within each
    expert (stable), and how many each expert has."""
    flat = top_k_index.reshape(-1)
    order = torch.sort(flat, stable=True)[1]
    return order, torch.bincount(flat, minlength=experts)


def kept_rows(counts: torch.Tensor, limit: int | None) -> tuple[torch.Tensor | None, list[int]]:
    """Rows (of a block sorted by expert with `counts` rows each) within each expert's first `limit`,
    as a boolean mask (None: all), and the kept counts."""
    if limit is None:
        return None, counts.tolist()
    starts = torch.cumsum(counts, 0) - counts
    expert_of = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)
    pos = torch.arange(int(counts.sum()), device=counts.device) - starts[expert_of]
    return pos < limit, counts.clamp(max=limit).tolist()


def combine(
    rows: torch.Tensor, order: torch.Tensor, top_k_weights: torch.Tensor, tokens: int, dtype: torch.dtype
) -> torch.Tensor:
    """Each token's expert outputs (rows, in `order`) weighted by the router and summed over its slots
    in slot order (as transformers does)."""
    k = top_k_weights.shape[-1]
    weighted = rows * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    slots = torch.zeros((tokens * k, rows.shape[-1]), dtype=weighted.dtype, device=rows.device)
    slots = slots.index_copy(0, order, weighted)
    return slots.view(tokens, k, -1).sum(dim=1).to(dtype)


def local_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: str,
    capacity_factor: float | None = None,
) -> torch.Tensor:
    """The whole layer on one device: hidden [T, H], top_k_index/weights [T, K] -> [T, H]."""
    experts, tokens = gate_up.shape[0], hidden.shape[0]
    order, counts = sort_by_expert(top_k_index, experts)
    limit = (
        None if capacity_factor is None else capacity(tokens, top_k_index.shape[-1], experts, capacity_factor)
    )
    keep, kept = kept_rows(counts, limit)
    k = top_k_index.shape[-1]
    x = hidden[order // k]
    if keep is None:
        return combine(expert_ffn(x, kept, gate_up, down, act), order, top_k_weights, tokens, hidden.dtype)
    out = x.new_zeros((x.shape[0], hidden.shape[-1]))
    out = out.index_copy(0, keep.nonzero().squeeze(-1), expert_ffn(x[keep], kept, gate_up, down, act))
    return combine(out, order, top_k_weights, tokens, hidden.dtype)
