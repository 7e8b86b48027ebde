"""Gradient buckets: contiguous slices of one flat buffer that are reduced with one collective each.

A `Bucket` holds the gradients of a few parameters back to back in `grads` (a slice of the reducer's
flat gradient buffer, padded to a multiple of the ZeRO group size). Gradients reach it in one of two
ways: a post-accumulate-grad hook copies (or adds) a fresh `.grad` into the bucket and drops it
(`accept`), or `materialize` copies whatever sits in `.grad` just before the bucket is reduced. After
the reduction the parameters' `.grad` are views of the bucket (`expose`), so the optimizer reads the
reduced values with no copy.

Under ZeRO each rank of the ZeRO group owns one contiguous `1/S`-th of every bucket (`own`), and the
bucket also holds the parameters themselves in a flat buffer (`data`) so one all-gather refreshes them.
With reduce-scatter only the owned slice is reduced; it accumulates in `shard_grads`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from nnscaler.runtime.comm import _all_gather_single, _reduce_scatter_single

__all__ = ["Bucket", "EMPTY", "LOCAL", "EXPOSED"]

EMPTY, LOCAL, EXPOSED = 0, 1, 2
"""Where a parameter's gradient is. EMPTY: not in the bucket (it may be in `.grad`); LOCAL: in the
bucket, added there by the hook (`.grad` is None); EXPOSED: the bucket's value, also set as `.grad`
(the user may have replaced or cleared `.grad` since, or accumulated into it in place)."""


class Bucket:
    """Gradients (and under ZeRO, values) of `params` in one contiguous slice of flat buffers."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        grads: torch.Tensor,
        data: torch.Tensor | None,
        shard_index: int,
        nshards: int,
    ) -> None:
        if grads.numel() % nshards != 0:
            raise ValueError(f"bucket of {grads.numel()} elements cannot be split in {nshards} shards")
        self.params = list(params)
        self.offsets: list[int] = []
        offset = 0
        for p in self.params:
            self.offsets.append(offset)
            offset += p.numel()
        self.numel = offset
        self.grads = grads
        self.views = [grads[o : o + p.numel()].view(p.shape) for o, p in zip(self.offsets, self.params)]
        self.data = data
        size = grads.numel() // nshards
        self.own = (shard_index * size, (shard_index + 1) * size)
        """This rank's ZeRO slice of the bucket: [start, end) in bucket coordinates."""
        self.shard_grads: torch.Tensor | None = None
        """Reduce-scatter mode: the reduced gradients of `own`, accumulated until `zero_grad`."""
        self._scatter_out: torch.Tensor | None = None
        self.state = [EMPTY] * len(self.params)
        self.arrived = [False] * len(self.params)
        self.narrived = 0
        self.works: list[Any] = []
        self.phase = 0
        """0: no reduction under way; 1: launched; 2: reduce-scatter done, cross-group all-reduce launched."""
        self.reduced = False
        """Launched since the end of the last `sync` (the reducer's round)."""
        self.dirty = False
        """New local gradients arrived since the last launch."""

    # ---- layout -----------------------------------------------------------------------------------------

    def own_pieces(self) -> list[tuple[int, int, int]]:
        """`(param index, start, end)` of each parameter's part inside `own` (start/end in the flattened
        parameter); parameters outside `own` are left out."""
        lo, hi = self.own
        pieces = []
        for i, (o, p) in enumerate(zip(self.offsets, self.params)):
            start, end = max(o, lo), min(o + p.numel(), hi)
            if start < end:
                pieces.append((i, start - o, end - o))
        return pieces

    def adopt_data(self) -> None:
        """Copy the parameters into `data` and make each parameter a view of it (ZeRO)."""
        assert self.data is not None
        with torch.no_grad():
            self.data[self.numel :].zero_()
            for o, p in zip(self.offsets, self.params):
                self.data[o : o + p.numel()].copy_(p.detach().reshape(-1))
                p.data = self.data[o : o + p.numel()].view(p.shape)

    def owns_data(self) -> bool:
        """Whether every parameter still is a view of `data` (`module.to(...)` breaks that)."""
        assert self.data is not None
        base = self.data.data_ptr()
        size = self.data.element_size()
        return all(p.data_ptr() == base + o * size for o, p in zip(self.offsets, self.params))

    # ---- gradients in ----------------------------------------------------------------------------------

    def _is_view(self, i: int, grad: torch.Tensor | None) -> bool:
        return grad is not None and grad.data_ptr() == self.views[i].data_ptr()

    def accept(self, i: int) -> bool:
        """Move parameter `i`'s fresh `.grad` into the bucket (a hook, after gradient accumulation).

        Returns True when this completes the bucket for the current backward pass.
        """
        p, view = self.params[i], self.views[i]
        grad = p.grad
        if grad is not None:
            if grad.is_sparse:
                raise NotImplementedError("sparse gradients are not supported by the gradient reducer")
            if self.state[i] == LOCAL:
                view.add_(grad)
            elif not (self.state[i] == EXPOSED and self._is_view(i, grad)):
                view.copy_(grad)
            self.state[i] = LOCAL
            p.grad = None
        self.dirty = True
        if not self.arrived[i]:
            self.arrived[i] = True
            self.narrived += 1
        return self.narrived == len(self.params)

    def materialize(self) -> None:
        """Bring every gradient into the bucket before it is reduced (zeros where there is none)."""
        for i, (p, view) in enumerate(zip(self.params, self.views)):
            if self.state[i] == LOCAL:
                continue
            grad = p.grad
            if grad is None:
                view.zero_()
            elif not self._is_view(i, grad):
                if grad.is_sparse:
                    raise NotImplementedError("sparse gradients are not supported by the gradient reducer")
                view.copy_(grad)
            self.state[i] = LOCAL
            p.grad = None
        if self.numel < self.grads.numel():
            self.grads[self.numel :].zero_()

    # ---- reduction ---------------------------------------------------------------------------------------

    def launch(self, group: dist.ProcessGroup, divisor: int, scatter: bool) -> None:
        """Start reducing the bucket over `group` asynchronously: divide by `divisor`, then sum.

        Dividing first keeps the values in range and makes a reduction of an already reduced bucket
        plus new local gradients (gradient accumulation without `no_sync`) come out right.
        `scatter`: reduce-scatter, this rank keeps its `own` slice; otherwise all-reduce in place.
        """
        self.materialize()
        if divisor != 1:
            self.grads.div_(divisor)
        if scatter:
            lo, hi = self.own
            if self._scatter_out is None:
                self._scatter_out = torch.empty_like(self.grads[lo:hi])
            self.works.append(
                _reduce_scatter_single(self._scatter_out, self.grads, group=group, async_op=True)
            )
        else:
            self.works.append(dist.all_reduce(self.grads, group=group, async_op=True))
        self.arrived = [False] * len(self.params)
        self.narrived = 0
        self.phase = 1
        self.reduced = True
        self.dirty = False

    def wait(self) -> None:
        """Wait for this bucket's collectives in flight."""
        for work in self.works:
            work.wait()
        self.works = []

    def launch_cross(self, group: dist.ProcessGroup | None) -> None:
        """Reduce-scatter with several ZeRO groups: once the scatter is done, sum the slice across groups."""
        if self.phase != 1 or group is None or self._scatter_out is None:
            return
        self.wait()
        self.works.append(dist.all_reduce(self._scatter_out, group=group, async_op=True))
        self.phase = 2

    def finish(self, scatter: bool) -> None:
        """Wait for the reduction and take its result in. All-reduce: the bucket holds it (and stays the
        base further local gradients are added to). Reduce-scatter: the slice is added to `shard_grads`
        and the bucket is emptied (what remains there is consumed)."""
        if self.phase == 0:
            return
        self.wait()
        self.phase = 0
        if not scatter:
            return
        assert self._scatter_out is not None
        if self.shard_grads is None:
            self.shard_grads, self._scatter_out = self._scatter_out, None
        else:
            self.shard_grads.add_(self._scatter_out)
        self.state = [EMPTY] * len(self.params)

    def expose(self) -> None:
        """Set every parameter's `.grad` to its view of the (reduced) bucket."""
        for i, (p, view) in enumerate(zip(self.params, self.views)):
            p.grad = view
            self.state[i] = EXPOSED

    def owned_grads(self) -> torch.Tensor:
        """This rank's slice of the reduced gradients (bucket coordinates `own`)."""
        if self.shard_grads is not None:
            return self.shard_grads
        lo, hi = self.own
        return self.grads[lo:hi]

    def reset(self) -> None:
        """Forget all gradients (zero_grad); waits for reductions in flight first."""
        self.wait()
        for i, p in enumerate(self.params):
            p.grad = None
            self.state[i] = EMPTY
        self.arrived = [False] * len(self.params)
        self.narrived = 0
        if self._scatter_out is None:
            self._scatter_out = self.shard_grads  # reuse the memory
        self.shard_grads = None
        self.phase = 0
        self.reduced = self.dirty = False

    # ---- ZeRO parameters ------------------------------------------------------------------------------------

    def launch_gather(self, group: dist.ProcessGroup) -> None:
        """All-gather the parameters from the owners of each slice (after the optimizer step)."""
        assert self.data is not None
        lo, hi = self.own
        self.works.append(_all_gather_single(self.data, self.data[lo:hi].clone(), group=group, async_op=True))
