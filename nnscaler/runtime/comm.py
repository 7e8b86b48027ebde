"""Autograd-aware collectives called by generated code (small autograd Functions over torch.distributed).

Every function is the plain local operation when `group` is None (one rank, or no process group).
`n` is the group size and `r` this rank's index in the group (ranks are ordered by global rank).
Sharded tensors follow `nnscaler.runtime.shard`: `blocks > 1` means a strided shard of `blocks`
equal contiguous blocks. Outputs of `copy_to_group` (and of `split_to_group` along dim 0) are views
of the input made inside an autograd Function: use them out of place (no `add_` on them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nnscaler.runtime.chunked_loss import vocab_parallel_chunk_linear_cross_entropy
from nnscaler.runtime.shard import shard_slice

__all__ = [
    "rank_in_group",
    "group_size",
    "copy_to_group",
    "reduce_from_group",
    "gather_from_group",
    "split_to_group",
    "reduce_scatter_to_group",
    "all_to_all_in_group",
    "vocab_parallel_embedding",
    "vocab_parallel_cross_entropy",
    "batch_parallel_cross_entropy",
    "batch_vocab_parallel_cross_entropy",
    "vocab_parallel_chunk_linear_cross_entropy",  # defined in nnscaler.runtime.chunked_loss
]

Group = dist.ProcessGroup | None
_REDUCTIONS = ("mean", "sum", "none")


# torch 2.13 renames all_gather_into_tensor / reduce_scatter_tensor (deprecated there) to *_single.
# Looked up at each call, so the communication timeline (runtime/timeline.py) sees them.
def _all_gather_single(*args: Any, **kwargs: Any) -> Any:
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def _reduce_scatter_single(*args: Any, **kwargs: Any) -> Any:
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


def rank_in_group(group: Group) -> int:
    """This rank's index in `group` (0 when `group` is None)."""
    return 0 if group is None else dist.get_rank(group)


def group_size(group: Group) -> int:
    """Number of ranks in `group` (1 when `group` is None)."""
    return 1 if group is None else dist.get_world_size(group)


# ---- plain collectives on contiguous tensors (no autograd) -------------------------------------------


def _all_reduce(x: torch.Tensor, group: Group, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=op, group=group)
    return out


def _gather(x: torch.Tensor, dim: int, group: Group, blocks: int) -> torch.Tensor:
    n = group_size(group)
    moved = x.movedim(dim, 0).contiguous()
    size, rest = moved.shape[0], tuple(moved.shape[1:])
    if size % blocks != 0:
        raise ValueError(f"gather: dim {dim} of size {size} is not divisible by blocks={blocks}")
    out = torch.empty((n * size,) + rest, dtype=x.dtype, device=x.device)
    _all_gather_single(out, moved, group=group)
    if blocks > 1:  # (n, blocks, c) -> (blocks, n, c): piece r of each block back in place
        out = out.view((n, blocks, size // blocks) + rest).transpose(0, 1).reshape((n * size,) + rest)
    return out.movedim(0, dim).contiguous()


def _split(x: torch.Tensor, dim: int, group: Group, blocks: int) -> torch.Tensor:
    return shard_slice(x, (dim, rank_in_group(group), group_size(group), blocks)).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group: Group, blocks: int) -> torch.Tensor:
    n = group_size(group)
    moved = x.movedim(dim, 0)
    size, rest = moved.shape[0], tuple(moved.shape[1:])
    if size % (n * blocks) != 0:
        raise ValueError(f"reduce_scatter: dim {dim} of size {size} is not divisible by {n} x {blocks}")
    c = size // (n * blocks)
    # (blocks, n, c) -> (n, blocks, c): rank r's strided shard becomes the r-th contiguous chunk
    inp = moved.reshape((blocks, n, c) + rest).transpose(0, 1).contiguous().view((size,) + rest)
    out = torch.empty((blocks * c,) + rest, dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, inp, group=group)
    return out.movedim(0, dim).contiguous()


def _all_to_all(x: torch.Tensor, src_dim: int, dst_dim: int, group: Group) -> torch.Tensor:
    n = group_size(group)
    moved = x.movedim(dst_dim, 0).contiguous()
    if moved.shape[0] % n != 0:
        raise ValueError(f"all_to_all: dim {dst_dim} of size {moved.shape[0]} is not divisible by {n}")
    out = torch.empty_like(moved)
    dist.all_to_all_single(out, moved, group=group)  # chunk i of out: rank i's piece of my dst shard
    pieces = [chunk.movedim(0, dst_dim) for chunk in out.chunk(n, dim=0)]
    return torch.cat(pieces, dim=src_dim).contiguous()


# ---- autograd functions -------------------------------------------------------------------------------


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad, None


class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Group, blocks: int) -> torch.Tensor:
        ctx.args = (dim, group, blocks)
        return _gather(x, dim, group, blocks)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _split(grad, *ctx.args), None, None, None


class _SplitToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Group, blocks: int) -> torch.Tensor:
        ctx.args = (dim, group, blocks)
        return _split(x, dim, group, blocks)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _gather(grad, *ctx.args), None, None, None


class _ReduceScatterToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Group, blocks: int) -> torch.Tensor:
        ctx.args = (dim, group, blocks)
        return _reduce_scatter(x, dim, group, blocks)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _gather(grad, *ctx.args), None, None, None


class _AllToAllInGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, src_dim: int, dst_dim: int, group: Group) -> torch.Tensor:
        ctx.args = (src_dim, dst_dim, group)
        return _all_to_all(x, src_dim, dst_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        src_dim, dst_dim, group = ctx.args
        return _all_to_all(grad, dst_dim, src_dim, group), None, None, None


# ---- public collectives -------------------------------------------------------------------------------


def _trivial(group: Group) -> bool:
    return group is None or group_size(group) == 1


def copy_to_group(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Megatron's f: identity forward, all-reduce (sum) of the gradient backward."""
    return x if _trivial(group) else _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Megatron's g: all-reduce (sum) forward, identity backward."""
    return x if _trivial(group) else _ReduceFromGroup.apply(x, group)


def gather_from_group(x: torch.Tensor, dim: int, group: Group, blocks: int = 1) -> torch.Tensor:
    """All-gather the shards `x` along `dim` into the full tensor; backward keeps this rank's shard."""
    return x if _trivial(group) else _GatherFromGroup.apply(x, dim % x.dim(), group, blocks)


def split_to_group(x: torch.Tensor, dim: int, group: Group, blocks: int = 1) -> torch.Tensor:
    """Keep this rank's shard of `x` along `dim`; backward all-gathers the gradient."""
    return x if _trivial(group) else _SplitToGroup.apply(x, dim % x.dim(), group, blocks)


def reduce_scatter_to_group(x: torch.Tensor, dim: int, group: Group, blocks: int = 1) -> torch.Tensor:
    """Sum `x` over the group and keep this rank's shard along `dim`; backward all-gathers."""
    return x if _trivial(group) else _ReduceScatterToGroup.apply(x, dim % x.dim(), group, blocks)


def all_to_all_in_group(x: torch.Tensor, src_dim: int, dst_dim: int, group: Group) -> torch.Tensor:
    """Re-shard: `x` is sharded on `src_dim`; the result is full on `src_dim` and sharded on `dst_dim`."""
    src_dim, dst_dim = src_dim % x.dim(), dst_dim % x.dim()
    if src_dim == dst_dim:
        raise ValueError(f"all_to_all_in_group: src_dim and dst_dim are both {src_dim}")
    return x if _trivial(group) else _AllToAllInGroup.apply(x, src_dim, dst_dim, group)


def vocab_parallel_embedding(
    idx: torch.Tensor, weight_shard: torch.Tensor, vocab_start: int, padding_idx: int | None = None
) -> torch.Tensor:
    """Embedding with rows `[vocab_start, vocab_start + rows)` of the table; other ids give zeros.

    The result is a partial sum over the group: follow it with `reduce_from_group`.
    `padding_idx` is a global (non-negative) id.
    """
    rows = weight_shard.shape[0]
    outside = (idx < vocab_start) | (idx >= vocab_start + rows)
    local = (idx - vocab_start).masked_fill(outside, 0)
    pad = None
    if padding_idx is not None:
        if padding_idx < 0:
            raise ValueError(
                f"vocab_parallel_embedding: padding_idx must be a global id >= 0, got {padding_idx}"
            )
        if vocab_start <= padding_idx < vocab_start + rows:
            pad = padding_idx - vocab_start
    return F.embedding(local, weight_shard, padding_idx=pad).masked_fill(outside.unsqueeze(-1), 0.0)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        vocab_start: int,
        group: Group,
        ignore_index: int,
        reduction: str,
        label_smoothing: float,
    ) -> torch.Tensor:
        x = logits.float()
        n_local = x.shape[-1]
        lmax = x.max(dim=-1).values
        if group is not None:
            dist.all_reduce(lmax, op=dist.ReduceOp.MAX, group=group)
        valid = target != ignore_index
        mine = valid & (target >= vocab_start) & (target < vocab_start + n_local)
        local_t = (target - vocab_start).masked_fill(~mine, 0)
        picked = (x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) - lmax).masked_fill(~mine, 0.0)
        softmax = (x - lmax.unsqueeze(-1)).exp_()  # the only [N, V_local] tensor kept for backward
        parts = [softmax.sum(-1), picked]
        if label_smoothing > 0:
            parts.append(x.sum(-1) - n_local * lmax)
        n_vocab = torch.full((1,), float(n_local), dtype=x.dtype, device=x.device)  # a fill: no H2D copy
        flat = torch.cat([torch.stack(parts).flatten(), n_vocab])
        if group is not None:
            dist.all_reduce(flat, group=group)
        sums, vocab = flat[:-1].view(len(parts), -1), flat[-1]
        softmax.div_(sums[0].unsqueeze(-1))
        lse = sums[0].log()
        loss = lse - sums[1]
        if label_smoothing > 0:
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - sums[2] / vocab)
        loss = loss.masked_fill(~valid, 0.0)
        count = valid.sum()
        if reduction == "mean":
            out = loss.sum() / count
        elif reduction == "sum":
            out = loss.sum()
        else:
            out = loss
        ctx.save_for_backward(softmax, local_t, mine, valid, count, vocab)
        ctx.opts = (reduction, label_smoothing, logits.dtype)
        return out.to(logits.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, local_t, mine, valid, count, vocab = ctx.saved_tensors
        reduction, eps, dtype = ctx.opts
        g = softmax.clone()
        g.scatter_add_(-1, local_t.unsqueeze(-1), -(1.0 - eps) * mine.to(g.dtype).unsqueeze(-1))
        if eps > 0:
            g -= eps / vocab
        g *= valid.unsqueeze(-1)
        grad = grad.float()
        if reduction == "mean":
            g *= grad / count
        elif reduction == "sum":
            g *= grad
        else:
            g *= grad.unsqueeze(-1)
        return g.to(dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int,
    group: Group,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """`F.cross_entropy` over logits whose class dim (the last) is split across `group`.

    `logits` is `[..., V_local]`: this rank's contiguous vocabulary slice starting at `vocab_start`;
    `target` is `[...]` of global class ids. Returns the full-vocabulary loss (the same on every rank)
    and gives each rank the gradient of its logits slice.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"vocab_parallel_cross_entropy: reduction must be one of {_REDUCTIONS}, got {reduction!r}"
        )
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(
            f"vocab_parallel_cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}"
        )
    if tuple(logits.shape[:-1]) != tuple(target.shape):
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} and target {tuple(target.shape)} "
            "must agree on all but the last (class) dim"
        )
    lead = tuple(target.shape)
    out = _VocabParallelCrossEntropy.apply(
        logits.reshape(-1, logits.shape[-1]),
        target.reshape(-1),
        int(vocab_start),
        None if _trivial(group) else group,
        int(ignore_index),
        reduction,
        float(label_smoothing),
    )
    return out.view(lead) if reduction == "none" else out


def batch_vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int,
    vocab_group: Group,
    batch_group: Group,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Cross-entropy of a 2-D split: the classes (last dim) across `vocab_group`, the batch across
    `batch_group` (the other mesh axis). A PARTIAL value over `batch_group` (see
    `batch_parallel_cross_entropy`), the same on every rank of `vocab_group`."""
    if reduction != "mean":
        return vocab_parallel_cross_entropy(
            logits, target, vocab_start, vocab_group, ignore_index, reduction, label_smoothing
        )
    total = vocab_parallel_cross_entropy(
        logits, target, vocab_start, vocab_group, ignore_index, "sum", label_smoothing
    )
    with torch.no_grad():
        count = (target != ignore_index).sum().to(torch.float32)
        if not _trivial(batch_group):
            dist.all_reduce(count, group=batch_group)
    return (total / count).to(total.dtype)


def batch_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: Group,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Cross-entropy of a batch (dim 0) split across `group`, as a PARTIAL value.

    Summed over the group (`reduce_from_group`) it equals `F.cross_entropy` over the full batch: for
    "mean" it is the local sum divided by the global count of non-ignored targets. "none" returns
    the local per-element losses.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"batch_parallel_cross_entropy: reduction must be one of {_REDUCTIONS}, got {reduction!r}"
        )
    kw: dict[str, Any] = {"ignore_index": ignore_index, "label_smoothing": label_smoothing}
    if reduction != "mean":
        return F.cross_entropy(logits, target, reduction=reduction, **kw)
    total = F.cross_entropy(logits, target, reduction="sum", **kw)
    with torch.no_grad():
        count = (target != ignore_index).sum().to(torch.float32)
        if not _trivial(group):
            dist.all_reduce(count, group=group)
    return (total / count).to(total.dtype)
