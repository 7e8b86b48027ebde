"""Chunked linear + cross-entropy: per-token losses of `hidden @ weight.T` without the whole
(tokens x vocabulary) logits ever existing (nnScaler's `--enable_chunk_loss`).

The forward walks the tokens in chunks of `chunk_size` rows: each chunk's logits (float32 or wider)
give its losses and are dropped. The backward recomputes each chunk's logits, forms
`d_logits = (softmax - onehot) * grad`, writes that chunk's `d_hidden` and adds `d_logits^T @ hidden`
into `d_weight`. Peak extra memory is about `chunk_size x V` floats plus `d_weight`.

- `chunk_linear_cross_entropy` calls the custom op `torch.ops.nnscaler.chunk_linear_cross_entropy`,
  so torch.export captures it as one node (the compiler's annotation: "n k^, v k^, n -> n").
- `vocab_parallel_chunk_linear_cross_entropy` is the same loss with the weight's rows (the vocabulary)
  split over a process group, reduced Megatron-style (max, sum-exp and target logit per chunk).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["chunk_linear_cross_entropy", "vocab_parallel_chunk_linear_cross_entropy"]

Group = dist.ProcessGroup | None


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The softmax's dtype: float32, or the input's if wider (float64)."""
    return torch.promote_types(dtype, torch.float32)


def _check(name: str, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or labels.dim() != 1:
        raise ValueError(
            f"{name}: expected hidden (N, K), weight (V, K) and labels (N,), got shapes {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)} and {tuple(labels.shape)}; flatten the leading dims first "
            "(hidden.reshape(-1, K), labels.reshape(-1))"
        )
    if hidden.shape[1] != weight.shape[1] or hidden.shape[0] != labels.shape[0]:
        raise ValueError(
            f"{name}: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and labels "
            f"{tuple(labels.shape)} disagree: hidden and weight must share K, hidden and labels N"
        )
    if chunk <= 0:
        raise ValueError(f"{name}: chunk_size must be a positive number of rows, got {chunk}")


def _targets(
    labels: torch.Tensor, vocab_start: int, rows: int, ignore_index: int
) -> tuple[torch.Tensor, ...]:
    """(valid, mine, local target): rows not ignored, rows whose target is in this vocabulary slice,
    and the target's index in the slice (0 where it is not)."""
    valid = labels != ignore_index
    mine = valid & (labels >= vocab_start) & (labels < vocab_start + rows)
    return valid, mine, (labels - vocab_start).masked_fill(~mine, 0)


def _forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int,
    group: Group,
    ignore_index: int,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token losses (hidden's dtype) and log-sum-exps (float32+), one chunk of logits at a time."""
    acc = _acc_dtype(hidden.dtype)
    n = hidden.shape[0]
    losses = torch.empty(n, dtype=acc, device=hidden.device)
    lse = torch.empty(n, dtype=acc, device=hidden.device)
    for start in range(0, n, chunk_size):
        h, t = hidden[start : start + chunk_size], labels[start : start + chunk_size]
        x = (h @ weight.T).to(acc)  # the only (chunk, V_local) tensor
        lmax = x.max(dim=-1).values
        if group is not None:
            dist.all_reduce(lmax, op=dist.ReduceOp.MAX, group=group)
        valid, mine, local_t = _targets(t, vocab_start, weight.shape[0], ignore_index)
        picked = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        sums = torch.stack([x.sub_(lmax.unsqueeze(-1)).exp_().sum(-1), picked])
        del x
        if group is not None:
            dist.all_reduce(sums, group=group)
        chunk_lse = lmax + sums[0].log()
        lse[start : start + chunk_size] = chunk_lse
        losses[start : start + chunk_size] = (chunk_lse - sums[1]).masked_fill(~valid, 0.0)
    return losses.to(hidden.dtype), lse


def _backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    grad: torch.Tensor,
    lse: torch.Tensor | None,
    vocab_start: int,
    ignore_index: int,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_hidden, d_weight) of this rank's vocabulary slice, recomputing each chunk's logits;
    `lse` None: one rank holds the whole vocabulary and each chunk's log-sum-exp is recomputed."""
    acc = _acc_dtype(hidden.dtype)
    d_hidden = torch.empty_like(hidden)
    d_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
    grad = grad.to(acc)
    for start in range(0, hidden.shape[0], chunk_size):
        stop = start + chunk_size
        h, t = hidden[start:stop], labels[start:stop]
        x = (h @ weight.T).to(acc)
        if lse is None:  # softmax in place of the logits (logsumexp would hold a second block)
            g = x.sub_(x.max(dim=-1, keepdim=True).values).exp_()
            g.div_(g.sum(dim=-1, keepdim=True))
        else:
            g = x.sub_(lse[start:stop].unsqueeze(-1)).exp_()
        valid, mine, local_t = _targets(t, vocab_start, weight.shape[0], ignore_index)
        g.scatter_add_(-1, local_t.unsqueeze(-1), -mine.to(acc).unsqueeze(-1))
        g.mul_((grad[start:stop] * valid).unsqueeze(-1))
        g = g.to(hidden.dtype)
        d_hidden[start:stop] = g @ weight
        if d_weight.dtype == g.dtype:
            d_weight.addmm_(g.T, h)
        else:
            d_weight.add_(g.T @ h)
        del x, g  # before the next chunk's logits exist
    return d_hidden, d_weight.to(weight.dtype)


# ---- one rank: a custom op, one node in torch.export's graph ---------------------------------------


@torch.library.custom_op("nnscaler::chunk_linear_cross_entropy", mutates_args=())
def _chunk_ce_op(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int, chunk_size: int
) -> torch.Tensor:
    return _forward(hidden, weight, labels, 0, None, ignore_index, chunk_size)[0]


@_chunk_ce_op.register_fake
def _chunk_ce_fake(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int, chunk_size: int
) -> torch.Tensor:
    return hidden.new_empty(hidden.shape[0])


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    hidden, weight, labels, ignore_index, chunk_size = inputs
    ctx.save_for_backward(hidden, weight, labels)
    ctx.opts = (ignore_index, chunk_size)


def _op_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    hidden, weight, labels = ctx.saved_tensors
    ignore_index, chunk_size = ctx.opts
    d_hidden, d_weight = _backward(hidden, weight, labels, grad, None, 0, ignore_index, chunk_size)
    return d_hidden, d_weight, None, None, None


_chunk_ce_op.register_autograd(_op_backward, setup_context=_setup_context)


def chunk_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """Per-token losses `(N,)`: `F.cross_entropy(hidden @ weight.T, labels, reduction='none',
    ignore_index=ignore_index)` (0 where `labels == ignore_index`), computed `chunk_size` rows at a time.

    hidden `(N, K)`, weight `(V, K)` (e.g. the LM head's weight), labels `(N,)` int64. The (N, V)
    logits never exist whole: forward and backward each hold one `(chunk_size, V)` block. Traced by
    torch.export as the one node `nnscaler.chunk_linear_cross_entropy.default`, which nnscaler splits
    on tokens (data / sequence parallel) or on the vocabulary (`vocab_parallel_chunk_linear_cross_entropy`).
    """
    _check("chunk_linear_cross_entropy", hidden, weight, labels, chunk_size)
    return _chunk_ce_op(hidden, weight, labels, int(ignore_index), int(chunk_size))


# ---- vocabulary split over a process group -----------------------------------------------------------


class _VocabParallelChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight_shard: torch.Tensor,
        labels: torch.Tensor,
        vocab_start: int,
        group: Group,
        ignore_index: int,
        chunk_size: int,
        sync_hidden_grad: bool,
    ) -> torch.Tensor:
        losses, lse = _forward(hidden, weight_shard, labels, vocab_start, group, ignore_index, chunk_size)
        ctx.save_for_backward(hidden, weight_shard, labels, lse)  # lse: N floats, no logits
        ctx.opts = (vocab_start, group, ignore_index, chunk_size, sync_hidden_grad)
        return losses

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight_shard, labels, lse = ctx.saved_tensors
        vocab_start, group, ignore_index, chunk_size, sync = ctx.opts
        d_hidden, d_weight = _backward(
            hidden, weight_shard, labels, grad, lse, vocab_start, ignore_index, chunk_size
        )
        if sync and group is not None:  # each rank's d_hidden covers its slice of the vocabulary only
            dist.all_reduce(d_hidden, group=group)
        return d_hidden, d_weight, None, None, None, None, None, None


def vocab_parallel_chunk_linear_cross_entropy(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int,
    group: Group,
    ignore_index: int = -100,
    chunk_size: int = 1024,
    sync_hidden_grad: bool = True,
) -> torch.Tensor:
    """`chunk_linear_cross_entropy` with the vocabulary split over `group`: this rank holds weight
    rows `[vocab_start, vocab_start + V_local)`; `labels` are global ids. Every rank returns the same
    full-vocabulary per-token losses and gets the gradient of its weight rows.

    Per chunk the row max, sum of exponentials and target logit (held by one rank) are all-reduced,
    as in Megatron's vocab-parallel cross entropy; the backward recomputes the chunk's local logits
    from the saved per-row log-sum-exp. `d_hidden` is a partial sum over the group: it is all-reduced
    here unless `sync_hidden_grad=False` (the compiler's code, whose `copy_to_group` on `hidden` does it).
    `group` None (or of size 1) is the one-rank case.
    """
    _check("vocab_parallel_chunk_linear_cross_entropy", hidden, weight_shard, labels, chunk_size)
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    return _VocabParallelChunkedCE.apply(
        hidden,
        weight_shard,
        labels,
        int(vocab_start),
        group,
        int(ignore_index),
        int(chunk_size),
        bool(sync_hidden_grad),
    )
