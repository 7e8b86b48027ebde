"""Expert parallelism: each rank of an `ep` group holds E / ep experts and its own tokens; tokens go
to the ranks of their experts by all-to-all and their outputs come back by a second one.

Per call, in program order on every rank (so NCCL sees the same collectives everywhere):
1. counts: an all-to-all of [ep, E/ep + 1] integers (per destination: assignments per local expert
   of that rank, and this rank's token count, for the capacity rule);
2. dispatch: an all-to-all of the assignments' hidden rows with variable splits;
3. the local experts' grouped GEMM over the received rows, grouped by expert in global token order
   (source rank, then its token order: the single-device order);
4. return: the reverse all-to-all; the router weights and the sum over slots as on one device.
Autograd: the backward of an all-to-all is the reverse all-to-all (`all_to_all_v`).
Capacity (optional) drops at the receiving rank, after the dispatch, by the single-device rule.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from nnscaler.runtime.moe.experts import capacity, combine, expert_ffn, kept_rows, sort_by_expert

__all__ = ["all_to_all_v", "expert_parallel_experts", "RoutingLog", "routing_log", "record_routing"]


class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _AllToAllV.apply(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all_v(x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    """Rows [sum(send), ...] -> rows [sum(recv), ...]: `send[j]` rows to rank j of `group`, `recv[j]`
    rows from it (rank order); backward sends the gradients back the same way."""
    return _AllToAllV.apply(x, list(send), list(recv), group)


class RoutingLog:
    """The experts chosen at every call while recording (tests compare them with one device)."""

    def __init__(self) -> None:
        self.calls: list[torch.Tensor] | None = None


routing_log = RoutingLog()


def record_routing(top_k_index: torch.Tensor) -> None:
    if routing_log.calls is not None:
        routing_log.calls.append(top_k_index.detach().cpu().clone())


def _exchange_counts(counts: torch.Tensor, tokens: int, ep: int, group: Any) -> torch.Tensor:
    """[ep, E_local] assignments this rank sends -> [ep, E_local + 1] it receives (last: tokens), on the
    host. The exchange runs where `counts` lives (the hidden states' device: NCCL takes no CPU tensors)."""
    local = counts.numel() // ep
    column = torch.full((ep, 1), tokens, dtype=counts.dtype, device=counts.device)
    send = torch.cat([counts.view(ep, local), column], dim=1).to(torch.int64).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.cpu()


def _by_expert(recv_counts: torch.Tensor) -> torch.Tensor:
    """Rows received source-major (rank j: its rows of local expert 0, 1, ...) reordered expert-major
    (expert e: its rows from rank 0, 1, ...)."""
    ep, local = recv_counts.shape
    flat = recv_counts.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat
    segments = [(j * local + e) for e in range(local) for j in range(ep)]
    pieces = [torch.arange(int(flat[s]), dtype=torch.int64) + starts[s] for s in segments]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)


@torch.compiler.disable(
    reason="expert-parallel dispatch: its all-to-all split sizes are read from the routing on the host"
)
def expert_parallel_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    activation: str,
    capacity_factor: float | None = None,
    *,
    group: Any,
) -> torch.Tensor:
    """`torch.ops.nnscaler.moe_experts` with this rank's tokens and its E / ep experts (contiguous:
    rank r holds experts [r * E/ep, (r + 1) * E/ep)), over the expert-parallel `group`. Under
    `ComputeConfig.torch_compile` it runs eagerly, one graph break per call: its shapes depend on the
    routing (bincount, `.tolist()`), which dynamo would otherwise split into many small graphs."""
    record_routing(top_k_index)
    ep = dist.get_world_size(group)
    local = gate_up_proj.shape[0]
    experts, tokens, k = local * ep, hidden.shape[0], top_k_index.shape[-1]
    order, counts = sort_by_expert(top_k_index, experts)
    recv_counts = _exchange_counts(counts, tokens, ep, group)
    send_rows = counts.view(ep, local).sum(1).tolist()  # host syncs: the split sizes
    per_source = recv_counts[:, :local]
    recv_rows = per_source.sum(1).tolist()
    arrived = all_to_all_v(hidden[order // k], send_rows, recv_rows, group)
    regroup = _by_expert(per_source).to(hidden.device)
    x = arrived[regroup]
    limit = None
    if capacity_factor is not None:
        limit = capacity(int(recv_counts[:, local].sum()), k, experts, capacity_factor)
    keep, kept = kept_rows(per_source.sum(0).to(hidden.device), limit)
    if keep is not None:
        ys = x.new_zeros((x.shape[0], down_proj.shape[1]))
        ys = ys.index_copy(
            0, keep.nonzero().squeeze(-1), expert_ffn(x[keep], kept, gate_up_proj, down_proj, activation)
        )
    else:
        ys = expert_ffn(x, kept, gate_up_proj, down_proj, activation)
    back = ys.new_zeros(ys.shape).index_copy(0, regroup, ys)  # source-major again
    rows = all_to_all_v(back, recv_rows, send_rows, group)
    return combine(rows, order, top_k_weights, tokens, hidden.dtype)
