"""`context_parallel_attention`: torch's scaled_dot_product_attention when the sequence dim is split
over the ranks of a group. Checks the call, then runs the kind's composition (`hybrid.py`)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nnscaler.runtime.context_parallel.hybrid import HybridPlan, hybrid_attention
from nnscaler.runtime.context_parallel.schedule import CP_KINDS

__all__ = ["context_parallel_attention", "CP_KINDS"]


def _check_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool) -> None:
    if q.dim() < 3 or k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(
            "context_parallel_attention: q, k, v must be (..., heads, seq, dim) with the same number of "
            f"dims, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"context_parallel_attention: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if not (q.shape[-2] == k.shape[-2] == v.shape[-2]):
        raise ValueError(
            "context_parallel_attention: self-attention only: q, k, v must hold the same rows, got sequence "
            f"lengths {q.shape[-2]}, {k.shape[-2]}, {v.shape[-2]}"
        )
    hq, hkv = q.shape[-3], k.shape[-3]
    if v.shape[-3] != hkv or (hq != hkv and not enable_gqa) or hq % hkv != 0:
        raise ValueError(
            f"context_parallel_attention: {hq} query heads and {hkv} / {v.shape[-3]} key / value heads: "
            "they must be equal, or (enable_gqa=True) the query heads a multiple of the kv heads"
        )


def _check_mask(mask: torch.Tensor | None, q: torch.Tensor, s: int) -> None:
    if mask is None:
        return
    rows, cols = q.shape[-2], s
    ok = (
        mask.dim() >= 2
        and mask.dim() <= q.dim()
        and mask.shape[-2] in (1, rows)
        and mask.shape[-1] in (1, cols)
        and (mask.dtype == torch.bool or mask.is_floating_point())
    )
    if not ok:
        raise ValueError(
            f"context_parallel_attention: attn_mask {tuple(mask.shape)} ({mask.dtype}) must be bool or float, "
            f"broadcastable to (..., heads, {rows}, {cols}): this rank's {rows} rows and all {cols} columns"
        )


def _check_plan(kind: str, n: int, ulysses_size: int, hq: int, rows: int, causal: bool) -> HybridPlan:
    if kind not in CP_KINDS:
        raise ValueError(f"context_parallel_attention: kind must be one of {CP_KINDS}, got {kind!r}")
    u = {"ring": 1, "zigzag": 1, "ulysses": n}.get(kind, ulysses_size)
    if kind == "hybrid" and (u < 1 or n % u != 0):
        raise ValueError(
            f"context_parallel_attention: ulysses_size={ulysses_size} must divide the group size {n} (kind='hybrid')"
        )
    if hq % u != 0:
        raise ValueError(
            f"context_parallel_attention: kind={kind!r} splits the {hq} query heads over {u} ranks "
            f"(ulysses size), but {hq} is not divisible by {u}: use kind='ring' or 'zigzag', or another size"
        )
    zigzag = kind in ("zigzag", "hybrid")
    if zigzag and causal and n // u > 1 and rows % 2 != 0:
        raise ValueError(
            f"context_parallel_attention: kind={kind!r} with causal attention splits the sequence of "
            f"{rows * n} rows into 2 x {n} = {2 * n} equal chunks: it must be divisible by {2 * n} "
            "(pad the sequence, or use kind='ring')"
        )
    return HybridPlan(u, zigzag)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    group: Any,
    kind: str = "zigzag",
    ulysses_size: int = 1,
) -> torch.Tensor:
    """`F.scaled_dot_product_attention` over the whole sequence, restricted to this rank's rows.

    The rank at index r of `group` holds rows [r*S/N, (r+1)*S/N) of q (..., Hq, S/N, D) and of
    k, v (..., Hkv, S/N, D|E), and gets those rows of the output. `attn_mask` (bool, True =
    attend, or additive float) holds this rank's rows and all S columns. `is_causal` together
    with a mask applies both (as torch does). `group` None (or one rank) is plain SDPA.
    `kind`: "zigzag" (load-balanced causal ring), "ring", "ulysses" (needs Hq divisible by N),
    "hybrid" (Ulysses over `ulysses_size` consecutive ranks, zigzag ring across them).
    """
    if group is None or dist.get_world_size(group) == 1:
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
    if dropout_p > 0:
        raise ValueError(
            f"context_parallel_attention: dropout_p={dropout_p} is not supported under context parallelism: "
            "set the attention dropout to 0 (e.g. the model config's attention_dropout)"
        )
    _check_tensors(q, k, v, enable_gqa)
    n = dist.get_world_size(group)
    _check_mask(attn_mask, q, q.shape[-2] * n)
    plan = _check_plan(kind, n, ulysses_size, q.shape[-3], q.shape[-2], is_causal)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    out = hybrid_attention(q, k, v, attn_mask, causal=is_causal, scale=scale, group=group, plan=plan)
    return _sdpa_strides(out)


def _sdpa_strides(out: torch.Tensor) -> torch.Tensor:
    """The output laid out as torch's fused SDPA kernels lay theirs, (..., S, H, E) in memory: the
    traced program was captured with those strides, so `out.transpose(1, 2).view(b, s, h * e)` there
    needs no copy and export dropped the `.contiguous()` before it (nanoGPT's attention does this)."""
    if out.dim() < 3:
        return out
    return out.transpose(-3, -2).contiguous().transpose(-3, -2)
