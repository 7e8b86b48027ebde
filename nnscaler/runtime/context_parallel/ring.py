"""Ring attention over a process group, with its own backward.

Each ring position holds the rows `spec.layout[pos]` of q, k and v. Forward: K/V blocks travel
around the ring (one `batch_isend_irecv` per step, posted before the step's compute so the
transfer overlaps it); each block's partial output is merged by log-sum-exp. Backward: the K/V
blocks travel again and the dK/dV accumulators travel with them (one step behind); dQ accumulates
locally from the saved output and log-sum-exp. Memory per rank: two K/V blocks in flight, the
local q, k, v, output and log-sum-exp; nothing scales with the whole sequence.
The batches follow `schedule.forward_batches` / `schedule.backward_batches` exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nnscaler.runtime.context_parallel.blocks import (
    acc_dtype,
    add_rows,
    block_backward,
    block_forward,
    expand_kv,
    merge_into,
    pair_masks,
    reduce_kv,
    take_rows,
)
from nnscaler.runtime.context_parallel.layout import BlockPair, Layout, block_pairs
from nnscaler.runtime.context_parallel.schedule import RingBatch, backward_batches, forward_batches
from nnscaler.runtime.dist.p2p import P2POrderError, strict_p2p

__all__ = ["RingSpec", "ring_attention"]


@dataclass(frozen=True, eq=False)
class RingSpec:
    """What one ring attention call needs besides its tensors."""

    group: Any
    """The ring's process group (None: one rank)."""
    layout: Layout
    """Per ring position, the global segments of its local rows (q, k and v alike)."""
    causal: bool
    scale: float
    gqa: int = 1
    """Query heads per kv head."""
    mask_grad: bool = False
    """Whether the backward computes the gradient of a float mask (an additive bias that requires one)."""


def _where(group: Any) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _pack(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpack(buf: torch.Tensor, shapes: tuple[torch.Size, ...]) -> list[torch.Tensor]:
    sizes = [s.numel() for s in shapes]
    return [part.view(shape) for part, shape in zip(buf.split(sizes), shapes)]


_PHASES = {"forward": 0, "backward": 1}
_PAYLOADS = {"kv": 0, "dkv": 1}


def _header(batch: RingBatch, numel: int, device: torch.device) -> torch.Tensor:
    values = [_PHASES[batch.phase], _PAYLOADS[batch.payload], batch.step, numel]
    return torch.tensor(values, dtype=torch.int64, device=device)


class _CheckedWorks:
    """Strict P2P mode (NNSCALER_STRICT_P2P=1): every block travels with a header naming its phase,
    payload, step and size; waiting compares it with this rank's own batch, so two ranks whose ring
    programs disagree fail naming both ops instead of hanging or swapping data (as NCCL would)."""

    def __init__(self, works: list[Any], got: torch.Tensor, want: torch.Tensor, src: int) -> None:
        self.works, self.got, self.want, self.src = works, got, want, src

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        got, want = self.got.tolist(), self.want.tolist()
        if got != want:
            raise P2POrderError(
                f"context-parallel ring out of order: rank {dist.get_rank()} ran {_describe(want)} but ring rank "
                f"{self.src} sent {_describe(got)}; every rank of the ring must issue the same exchanges in the "
                "same order (nnscaler/runtime/context_parallel/schedule.py)"
            )


def _describe(header: list[int]) -> str:
    phase, payload, step, numel = header
    names = ({v: k for k, v in _PHASES.items()}[phase], {v: k for k, v in _PAYLOADS.items()}[payload])
    return f"the {names[0]} {names[1]} exchange of step {step} ({numel} elements)"


def _exchange(buf: torch.Tensor, batch: RingBatch, group: Any) -> tuple[torch.Tensor, list[Any]]:
    """Post one ring batch: send `buf`, receive a tensor like it. Returns (receive buffer, works)."""
    recv = torch.empty_like(buf)
    ops = []
    strict = strict_p2p()
    header_out = _header(batch, buf.numel(), buf.device) if strict else None
    header_in = torch.empty_like(header_out) if strict else None
    src = -1
    for op, peer in batch.ops:
        fn, tensor, extra = (dist.isend, buf, header_out) if op == "send" else (dist.irecv, recv, header_in)
        fn = getattr(fn, "__wrapped__", fn)  # P2POp takes torch's own isend / irecv, not a recording wrapper
        rank = dist.get_global_rank(group, peer)
        src = rank if op == "recv" else src
        if strict:
            ops.append(dist.P2POp(fn, extra, rank, group))
        ops.append(dist.P2POp(fn, tensor, rank, group))
    works = list(dist.batch_isend_irecv(ops))
    if strict:
        return recv, [_CheckedWorks(works, header_in, header_out, src)]
    return recv, works


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()


def _expect(batches: Iterator[RingBatch], payload: str, step: int) -> RingBatch:
    batch = next(batches)
    if (batch.payload, batch.step) != (payload, step):
        raise RuntimeError(f"ring schedule out of step: expected {payload}@{step}, schedule has {batch}")
    return batch


def _pairs(spec: RingSpec, pos: int, src: int) -> list[BlockPair]:
    return block_pairs(spec.layout[pos], spec.layout[src], spec.causal)


def _kv_block(
    kb: torch.Tensor, vb: torch.Tensor, pair: BlockPair, gqa: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return expand_kv(take_rows(kb, pair.kv_local), gqa), expand_kv(take_rows(vb, pair.kv_local), gqa)


def _forward_step(q, kb, vb, mask, pairs, spec, out, lse) -> None:  # noqa: ANN001
    for pair in pairs:
        allowed, bias = pair_masks(mask, pair, q.device)
        k, v = _kv_block(kb, vb, pair, spec.gqa)
        o, lb = block_forward(q.narrow(-2, *pair.q_local), k, v, spec.scale, allowed, bias)
        merge_into(out, lse, pair.q_local, o, lb)


def _ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, spec: RingSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    n, pos = _where(spec.group)
    dt = acc_dtype(q.dtype)
    out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=dt, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=dt, device=q.device)
    shapes = (k.shape, v.shape)
    kv = _pack(k, v) if n > 1 else None
    batches = forward_batches(n, pos)
    for t in range(n):
        pending = _exchange(kv, batches[t], spec.group) if t < n - 1 else None
        kb, vb = _unpack(kv, shapes) if kv is not None else (k, v)
        _forward_step(q, kb, vb, mask, _pairs(spec, pos, (pos - t) % n), spec, out, lse)
        if pending is not None:
            _wait(pending[1])
            kv = pending[0]
    return out, lse


def _backward_step(q, kb, vb, mask, pairs, spec, dout, delta, lse, dq, dkb, dvb, dmask) -> None:  # noqa: ANN001
    for pair in pairs:
        rows = pair.q_local
        allowed, bias = pair_masks(mask, pair, q.device)
        k, v = _kv_block(kb, vb, pair, spec.gqa)
        grads = block_backward(
            q.narrow(-2, *rows),
            k,
            v,
            spec.scale,
            allowed,
            bias,
            dout.narrow(-2, *rows),
            delta.narrow(-1, *rows),
            lse.narrow(-1, *rows),
            bias_grad=dmask is not None,
        )
        dqp, dkp, dvp = grads[:3]
        dq.narrow(-2, *rows).add_(dqp)
        add_rows(dkb, pair.kv_local, reduce_kv(dkp, spec.gqa))
        add_rows(dvb, pair.kv_local, reduce_kv(dvp, spec.gqa))
        if dmask is not None:  # the bias block's gradient, back to its rows and key columns
            block = dmask if dmask.shape[-2] == 1 else dmask.narrow(-2, *rows)
            if dmask.shape[-1] == 1:
                block.add_(grads[3])
            else:
                add_rows(block, pair.kv_global, grads[3], dim=-1)


def _ring_backward(
    dout: torch.Tensor, saved: tuple[torch.Tensor, ...], spec: RingSpec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v, out, lse, mask = saved
    n, pos = _where(spec.group)
    dt = acc_dtype(q.dtype)
    grad_mask = mask is not None and mask.is_floating_point() and spec.mask_grad
    dmask = torch.zeros(mask.shape, dtype=dt, device=mask.device) if grad_mask else None
    dout = dout.to(dt)
    delta = (dout * out.to(dt)).sum(-1)
    dq = torch.zeros(q.shape, dtype=dt, device=q.device)
    shapes = (k.shape, v.shape)
    kv = _pack(k, v) if n > 1 else None
    batches = iter(backward_batches(n, pos))
    dkv_pending = None
    for t in range(n):
        kv_pending = _exchange(kv, _expect(batches, "kv", t), spec.group) if t < n - 1 else None
        kb, vb = _unpack(kv, shapes) if kv is not None else (k, v)
        dkb = torch.zeros(k.shape, dtype=dt, device=k.device)
        dvb = torch.zeros(v.shape, dtype=dt, device=v.device)
        pairs = _pairs(spec, pos, (pos - t) % n)
        _backward_step(q, kb, vb, mask, pairs, spec, dout, delta, lse, dq, dkb, dvb, dmask)
        if n == 1:
            return dq, dkb, dvb, dmask
        dkv = _pack(dkb, dvb)
        if dkv_pending is not None:  # the accumulator of this block, from the ranks before
            _wait(dkv_pending[1])
            dkv += dkv_pending[0]
        dkv_pending = _exchange(dkv, _expect(batches, "dkv", t), spec.group)
        if kv_pending is not None:
            _wait(kv_pending[1])
            kv = kv_pending[0]
    _wait(dkv_pending[1])  # every block's accumulator is back at its owner
    dk, dv = _unpack(dkv_pending[0], (k.shape, v.shape))
    return dq, dk, dv, dmask


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q, k, v, mask, spec: RingSpec) -> torch.Tensor:  # noqa: ANN001
        out, lse = _ring_forward(q, k, v, mask, spec)
        out = out.to(q.dtype)
        ctx.spec = dataclasses.replace(spec, mask_grad=ctx.needs_input_grad[3])
        ctx.save_for_backward(q, k, v, out, lse, mask)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v = ctx.saved_tensors[:3]
        dq, dk, dv, dmask = _ring_backward(dout, ctx.saved_tensors, ctx.spec)
        mask = ctx.saved_tensors[5]
        dmask = dmask.to(mask.dtype) if dmask is not None else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dmask, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, spec: RingSpec
) -> torch.Tensor:
    """Attention of this position's rows of q against all keys of the ring, with autograd.

    q: (..., Hq, L, D), k: (..., Hkv, L, D), v: (..., Hkv, L, E) holding the rows
    `spec.layout[pos]`; `mask` (bool, or an additive float bias, which gets its gradient when it
    requires one) has this rank's rows in the same
    local order (or one row) and all S global columns (or one column).
    """
    return _RingAttention.apply(q, k, v, mask, spec)
