"""Attention on one (query block, key block) pair in plain torch: scores and a numerically stable
softmax in float32 (float64 for float64 inputs), returning the output and the log-sum-exp of each
row; the log-sum-exp merge of partial results; and the matching flash-attention-style backward
that recomputes the probabilities from the saved log-sum-exp.

Fully masked rows give output 0 and log-sum-exp -inf (torch's SDPA also returns 0 there).
"""

from __future__ import annotations

import torch

from nnscaler.runtime.context_parallel.layout import BlockPair, Seg

__all__ = [
    "acc_dtype",
    "expand_kv",
    "reduce_kv",
    "take_rows",
    "add_rows",
    "pair_masks",
    "block_forward",
    "block_backward",
    "sum_to",
    "merge_into",
]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype blocks accumulate in: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """GQA: repeat each K/V head `groups` times (query head h reads kv head h // groups)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=-3)


def reduce_kv(dx: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of `expand_kv`: sum over the copies of each kv head."""
    return dx if groups == 1 else dx.unflatten(-3, (-1, groups)).sum(-3)


def _merged(segs: tuple[Seg, ...]) -> list[Seg]:
    out: list[Seg] = []
    for start, length in segs:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((start, length))
    return out


def take_rows(x: torch.Tensor, segs: tuple[Seg, ...], dim: int = -2) -> torch.Tensor:
    """The rows `segs` ((start, length) along `dim`) of `x`, concatenated (a view when adjacent)."""
    parts = [x.narrow(dim, start, length) for start, length in _merged(segs)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def add_rows(acc: torch.Tensor, segs: tuple[Seg, ...], value: torch.Tensor, dim: int = -2) -> None:
    """`acc[rows of segs] += value` (value holds those rows concatenated, along `dim`), in place."""
    at = 0
    for start, length in _merged(segs):
        acc.narrow(dim, start, length).add_(value.narrow(dim, at, length))
        at += length


def pair_masks(
    mask: torch.Tensor | None, pair: BlockPair, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(allowed, bias) for a block pair: `allowed` is a bool mask (user bool mask and causal),
    `bias` the user's float mask; either may be None. `mask` has this rank's rows (or one row)
    in local order and all columns (or one column)."""
    allowed, bias = None, None
    if mask is not None:
        m = mask
        if m.shape[-2] != 1:
            m = m.narrow(-2, *pair.q_local)
        if m.shape[-1] != 1:
            m = take_rows(m, pair.kv_global, dim=-1)
        allowed, bias = (m, None) if m.dtype == torch.bool else (None, m)
    if pair.causal:
        q_pos = torch.arange(pair.q_global[0], sum(pair.q_global), device=device)
        k_pos = torch.cat([torch.arange(s, s + n, device=device) for s, n in pair.kv_global])
        causal = k_pos[None, :] <= q_pos[:, None]
        allowed = causal if allowed is None else allowed & causal
    return allowed, bias


def _scores(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    allowed: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    dt = acc_dtype(q.dtype)
    s = torch.matmul(q.to(dt), k.to(dt).transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.to(dt)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return s


def _block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    allowed: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale + bias, masked to `allowed`) v, and the rows' log-sum-exp (acc dtype).
    k and v have as many heads as q (see `expand_kv`)."""
    s = _scores(q, k, scale, allowed, bias)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    total = p.sum(-1, keepdim=True)
    out = torch.matmul(p, v.to(s.dtype)) / torch.where(total > 0, total, torch.ones_like(total))
    return out, (m + torch.log(total)).squeeze(-1)


def _block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    allowed: torch.Tensor | None,
    bias: torch.Tensor | None,
    dout: torch.Tensor,
    delta: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, ds) of one block, given the final rows' log-sum-exp `lse` and
    `delta` = rowsum(dout * out) of the final output (dout, delta, lse in the acc dtype); `ds` is the
    gradient of the scores after scaling, i.e. of an additive bias."""
    s = _scores(q, k, scale, allowed, bias)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(s - safe.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dout)
    dp = torch.matmul(dout, v.to(s.dtype).transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k.to(s.dtype)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.to(s.dtype)) * scale
    return dq, dk, dv, ds


TILE_ELEMENTS = 1 << 16
"""Scores per (batch, head) one tile of query rows may hold: a block runs its query rows in tiles of
TILE_ELEMENTS // key rows (at least 16), so the float32 scores, probabilities and their gradients
of a block never exist whole (a 1,024 x 1,024 block of 8 heads would be 32 MiB per matrix)."""


def _tiles(rows: int, keys: int) -> list[tuple[int, int]]:
    size = max(16, TILE_ELEMENTS // max(keys, 1))
    return [(start, min(size, rows - start)) for start in range(0, rows, size)]


def _row_slice(x: torch.Tensor | None, start: int, length: int) -> torch.Tensor | None:
    """Rows [start, start + length) of a per-row tensor (a mask with one broadcast row stays whole)."""
    if x is None or x.shape[-2] == 1:
        return x
    return x.narrow(-2, start, length)


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    allowed: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale + bias, masked to `allowed`) v, and the rows' log-sum-exp (acc dtype),
    computed in tiles of query rows (TILE_ELEMENTS). k and v have as many heads as q (`expand_kv`)."""
    tiles = _tiles(q.shape[-2], k.shape[-2])
    if len(tiles) == 1:
        return _block_forward(q, k, v, scale, allowed, bias)
    outs, lses = [], []
    for start, length in tiles:
        o, lse = _block_forward(
            q.narrow(-2, start, length),
            k,
            v,
            scale,
            _row_slice(allowed, start, length),
            _row_slice(bias, start, length),
        )
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    allowed: torch.Tensor | None,
    bias: torch.Tensor | None,
    dout: torch.Tensor,
    delta: torch.Tensor,
    lse: torch.Tensor,
    bias_grad: bool = False,
) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) of one block (see `_block_backward`), in tiles of query rows; with `bias_grad`
    also the gradient of `bias` (summed over the dims it broadcasts along)."""
    tiles = _tiles(q.shape[-2], k.shape[-2])
    dqs, dk, dv, dbias = [], None, None, []
    for start, length in tiles:
        whole = len(tiles) == 1
        bias_t = bias if whole else _row_slice(bias, start, length)
        dq_t, dk_t, dv_t, ds_t = _block_backward(
            q if whole else q.narrow(-2, start, length),
            k,
            v,
            scale,
            allowed if whole else _row_slice(allowed, start, length),
            bias_t,
            dout if whole else dout.narrow(-2, start, length),
            delta if whole else delta.narrow(-1, start, length),
            lse if whole else lse.narrow(-1, start, length),
        )
        dqs.append(dq_t)
        dk = dk_t if dk is None else dk.add_(dk_t)
        dv = dv_t if dv is None else dv.add_(dv_t)
        if bias_grad and bias is not None:
            dbias.append(sum_to(ds_t, bias_t.shape))
    dq = dqs[0] if len(dqs) == 1 else torch.cat(dqs, dim=-2)
    if not bias_grad:
        return dq, dk, dv
    if bias is None:
        return dq, dk, dv, None
    if bias.shape[-2] == 1:  # one broadcast row: the tiles' sums add up
        return dq, dk, dv, torch.stack(dbias).sum(0)
    return dq, dk, dv, dbias[0] if len(dbias) == 1 else torch.cat(dbias, dim=-2)


def sum_to(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`x` summed over the dims a tensor of `shape` broadcasts along to reach it (as autograd does)."""
    shape = tuple(shape)
    if x.shape == shape:
        return x
    lead = x.dim() - len(shape)
    x = x.sum(tuple(range(lead))) if lead else x
    dims = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return x.sum(dims, keepdim=True) if dims else x


def merge_into(
    out_acc: torch.Tensor, lse_acc: torch.Tensor, rows: Seg, out: torch.Tensor, lse: torch.Tensor
) -> None:
    """Merge a partial result (out, lse) for local rows `rows` into the accumulators, in place."""
    o_acc, l_acc = out_acc.narrow(-2, *rows), lse_acc.narrow(-1, *rows)
    new = torch.logaddexp(l_acc, lse)
    safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
    w_old, w_new = torch.exp(l_acc - safe).unsqueeze(-1), torch.exp(lse - safe).unsqueeze(-1)
    o_acc.copy_(o_acc * w_old + out * w_new)
    l_acc.copy_(new)
