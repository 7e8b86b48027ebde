"""Gradient buckets: contiguous buffers whose gradients are reduced with one collective each.

A `Bucket` holds the gradients of a few parameters back to back in `grads` (padded to a multiple of
the ZeRO group size). Gradients reach it in one of three ways: a post-accumulate-grad hook copies (or
adds) a fresh `.grad` into the bucket and drops it (`accept`), ZeRO-3's backward hands a gradient over
directly (`accept(i, grad)`), or `materialize` copies whatever sits in `.grad` just before the bucket
is reduced. After an all-reduce the parameters' `.grad` are views
of the bucket (`expose`), so the optimizer reads the reduced values with no copy.

Under ZeRO each rank of the ZeRO group owns one contiguous `1/S`-th of every bucket (`own`), and the
bucket also holds the parameters themselves in a flat buffer (`data`) so one all-gather refreshes them.
With reduce-scatter only the owned slice is reduced; it accumulates in `shard_grads`. A `transient`
bucket (ZeRO stage 2) allocates `grads` when the first gradient arrives and frees it once its
reduce-scatter is taken in, so only the owned slices of the gradients stay in memory.

The gradient buffers may have a wider dtype than the parameters (`grad_dtype`: fp32 copies of bf16 /
fp16 gradients, `ComputeConfig.reduce_grads_in_fp32`): gradients are cast up as they enter the bucket
and reduced in fp32; after an all-reduce each parameter's `.main_grad` (Megatron's name) is its fp32
view of the bucket and `.grad` is None, so only an optimizer that reads `.main_grad`
(`MixedPrecisionAdam(W)`) sees them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from nnscaler.runtime.comm import _all_gather_single, _reduce_scatter_single

__all__ = [
    "Bucket",
    "EMPTY",
    "LOCAL",
    "EXPOSED",
    "pack_buckets",
    "make_buckets",
    "flat_buckets",
    "DEFAULT_BUCKET_CAP_MB",
]

T = TypeVar("T")


def pack_buckets(
    items: Sequence[T], key: Callable[[T], Hashable], nbytes: Callable[[T], int], cap: int
) -> list[list[T]]:
    """Group `items` (in order) into buckets of one `key` each holding at most `cap` bytes; an item
    larger than `cap` gets a bucket of its own. Buckets close as they fill, the rest in key order seen."""
    open_buckets: dict[Hashable, tuple[list[T], int]] = {}
    out: list[list[T]] = []
    for item in items:
        k, size = key(item), nbytes(item)
        bucket, used = open_buckets.get(k, ([], 0))
        if bucket and used + size > cap:
            out.append(bucket)
            bucket, used = [], 0
        bucket.append(item)
        open_buckets[k] = (bucket, used + size)
    out.extend(b for b, _ in open_buckets.values() if b)
    return out


DEFAULT_BUCKET_CAP_MB = 25.0
"""Bucket size when `ComputeConfig.reducer_bucket_cap_mb` is None (torch DDP's default)."""


def make_buckets(
    params: Sequence[torch.Tensor], cap_mb: float | None, groups: Mapping[int, Any] | None = None
) -> list[list[torch.Tensor]]:
    """Split `params` (in order) into buckets of one dtype and device, each at most `cap_mb` MB.

    A parameter larger than the cap gets a bucket of its own; `cap_mb == 0` gives one bucket per tensor.
    `groups` (id of a parameter -> the group its gradient is reduced over, when not the reducer's): a
    bucket holds parameters of one group only.
    """
    cap = int((DEFAULT_BUCKET_CAP_MB if cap_mb is None else cap_mb) * 1024 * 1024)
    where = groups or {}
    return pack_buckets(
        params,
        lambda p: (p.dtype, p.device, id(where.get(id(p)))),
        lambda p: p.numel() * p.element_size(),
        cap,
    )


EMPTY, LOCAL, EXPOSED = 0, 1, 2
"""Where a parameter's gradient is. EMPTY: not in the bucket (it may be in `.grad`); LOCAL: in the
bucket, added there by the hook (`.grad` is None); EXPOSED: the bucket's value, also set as `.grad`
(the user may have replaced or cleared `.grad` since, or accumulated into it in place)."""


def _check_dense(grad: torch.Tensor) -> None:
    if grad.is_sparse:
        raise NotImplementedError("sparse gradients are not supported by the gradient reducer")


class Bucket:
    """Gradients (and under ZeRO, values) of `params` in contiguous buffers of `size` elements."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        size: int,
        grads: torch.Tensor | None,
        data: torch.Tensor | None,
        shard_index: int,
        nshards: int,
        divisor: int,
        grad_dtype: torch.dtype | None = None,
    ) -> None:
        if size % nshards != 0:
            raise ValueError(f"bucket of {size} elements cannot be split in {nshards} shards")
        self.params = list(params)
        self.offsets: list[int] = []
        offset = 0
        for p in self.params:
            self.offsets.append(offset)
            offset += p.numel()
        self.numel = offset
        self.size = size
        self.kind = (self.params[0].dtype, self.params[0].device)
        """dtype and device the buffers were made for."""
        self.grad_dtype = grad_dtype or self.kind[0]
        """dtype of the gradient buffers (and of the reduction)."""
        self.upcast = self.grad_dtype != self.kind[0]
        """Gradients are kept wider than the parameters: exposed as `.main_grad`, not `.grad`."""
        self.transient = grads is None
        """Allocate `grads` on demand and free it after each reduce-scatter (ZeRO stage 2)."""
        self.grads: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        if grads is not None:
            self._set_grads(grads)
        self.data = data
        shard = size // nshards
        self.own = (shard_index * shard, (shard_index + 1) * shard)
        """This rank's ZeRO slice of the bucket: [start, end) in bucket coordinates."""
        self.shard_grads: torch.Tensor | None = None
        """Reduce-scatter mode: the reduced gradients of `own`, accumulated until `reset`."""
        self._scatter_out: torch.Tensor | None = None
        self.divisor = divisor
        """Gradients are divided by this (the data-parallel size) before they are summed."""
        self.state = [EMPTY] * len(self.params)
        self.scaled = [False] * len(self.params)
        """Whether a parameter's region in the bucket is divided by `divisor` already."""
        self.arrived = [False] * len(self.params)
        self.narrived = 0
        self.works: list[Any] = []
        self.phase = 0
        """0: no reduction under way; 1: launched; 2: reduce-scatter done, cross-group all-reduce launched."""
        self.reduced = False
        """Launched since the end of the reducer's last `sync`."""
        self.dirty = False
        """New local gradients arrived since the last launch."""
        self.prepared = False
        """`prepare` ran since the last launch: the bucket holds this rank's divided contribution."""
        self.group: dist.ProcessGroup | None = None
        """Set: reduce with one all-reduce over this group instead of the reducer's (weights held whole
        along plan axes where their readers split the batch: their ranks on those axes with every replica)."""

    # ---- layout -----------------------------------------------------------------------------------------

    def _set_grads(self, grads: torch.Tensor) -> None:
        self.grads = grads
        self.views = [grads[o : o + p.numel()].view(p.shape) for o, p in zip(self.offsets, self.params)]

    def _ensure_grads(self) -> torch.Tensor:
        if self.grads is None:
            p = self.params[0]
            self._set_grads(torch.empty(self.size, dtype=self.grad_dtype, device=p.device))
        assert self.grads is not None
        return self.grads

    def _release_grads(self) -> None:
        if self.transient:
            self.grads, self.views = None, []

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
        return grad is not None and bool(self.views) and grad.data_ptr() == self.views[i].data_ptr()

    def _holds_reduced(self, i: int) -> bool:
        """Whether parameter `i`'s region holds the last reduced values, still exposed to the user (new
        local gradients are then added to them): `.grad` (or, upcast, `.main_grad`) is its view."""
        if self.state[i] != EXPOSED:
            return False
        if self.upcast:
            return bool(self.views) and getattr(self.params[i], "main_grad", None) is self.views[i]
        return self._is_view(i, self.params[i].grad)

    def _copy_in(self, view: torch.Tensor, grad: torch.Tensor) -> None:
        """`view = grad / divisor` (cast up first when the bucket is wider, so nothing rounds in bf16)."""
        if self.upcast:
            view.copy_(grad).div_(self.divisor)
        else:
            torch.div(grad, self.divisor, out=view)  # copy and pre-divide in one pass

    def accept(self, i: int, grad: torch.Tensor | None = None, arrive: bool = True) -> bool:
        """Move parameter `i`'s fresh `.grad` into the bucket (a hook, after gradient accumulation), or
        add `grad` to it when given (ZeRO-3 hands gradients over directly; `.grad` is left alone).

        `arrive`: this is the parameter's last gradient of the backward pass. Returns True when this
        completes the bucket for the current backward pass.
        """
        p = self.params[i]
        given = grad is not None
        if not given:
            grad = p.grad
        if grad is not None:
            _check_dense(grad)
            self._ensure_grads()
            view = self.views[i]
            if self.state[i] == LOCAL:
                view.add_(grad, alpha=1 / self.divisor if self.scaled[i] else 1)
            elif self._holds_reduced(i):
                if self.upcast:
                    view.add_(grad)
                self.scaled[i] = False  # accumulated (in place, unless upcast) into the reduced values
            else:
                self._copy_in(view, grad)
                self.scaled[i] = True
            self.state[i] = LOCAL
            if not given:
                p.grad = None
        self.dirty = True
        if arrive and not self.arrived[i]:
            self.arrived[i] = True
            self.narrived += 1
        return self.narrived == len(self.params)

    def materialize(self) -> None:
        """Bring every gradient into the bucket before it is reduced (zeros where there is none)."""
        grads = self._ensure_grads()
        for i, (p, view) in enumerate(zip(self.params, self.views)):
            if self.state[i] == LOCAL:
                continue
            grad = p.grad
            if self._holds_reduced(i):
                if self.upcast and grad is not None:
                    _check_dense(grad)
                    view.add_(grad)
                self.scaled[i] = False
            elif grad is None:
                view.zero_()
                self.scaled[i] = True
            else:
                _check_dense(grad)
                self._copy_in(view, grad)
                self.scaled[i] = True
            self.state[i] = LOCAL
            p.grad = None
        if self.numel < self.size:
            grads[self.numel :].zero_()

    # ---- reduction ---------------------------------------------------------------------------------------

    def prepare(self) -> torch.Tensor:
        """Bring every gradient in and divide the bucket by `divisor` (once until the next launch): what
        this rank contributes to the reduction. Returns `grads` (robust aggregation and fault injection
        read and change it between this and `launch`)."""
        grads = self._ensure_grads()
        if self.prepared:
            return grads
        self.materialize()
        if not any(self.scaled):  # all accumulated in place (gradients as bucket views): one pass
            grads.div_(self.divisor)
        else:
            for view, scaled in zip(self.views, self.scaled):
                if not scaled:
                    view.div_(self.divisor)
        self.scaled = [False] * len(self.params)  # what comes back is reduced, not divided
        self.prepared = True
        return grads

    def launch(
        self, group: dist.ProcessGroup, scatter: bool, start: Callable[[Bucket], Any] | None = None
    ) -> None:
        """Start reducing the bucket over `group` asynchronously: divide by `divisor`, then sum.

        Gradients are divided when they enter the bucket (one pass with the copy) or here. Dividing
        first keeps the values in range and makes a reduction of an already reduced bucket plus new
        local gradients (gradient accumulation without `no_sync`) come out right.
        `scatter`: reduce-scatter, this rank keeps its `own` slice; otherwise all-reduce in place.
        `start`: launch this collective instead (robust aggregation; it returns the work to wait for).
        """
        grads = self.prepare()
        if start is not None:
            self.works.append(start(self))
        elif scatter:
            lo, hi = self.own
            if self._scatter_out is None:
                self._scatter_out = torch.empty_like(grads[lo:hi])
            self.works.append(_reduce_scatter_single(self._scatter_out, grads, group=group, async_op=True))
        else:
            self.works.append(dist.all_reduce(grads, group=group, async_op=True))
        self.arrived = [False] * len(self.params)
        self.narrived = 0
        self.phase = 1
        self.reduced = True
        self.dirty = self.prepared = False

    def wait(self) -> None:
        """Wait for this bucket's collectives in flight."""
        for work in self.works:
            work.wait()
        self.works = []

    def done(self) -> bool:
        """Whether the collectives in flight have completed (without waiting)."""
        return all(work.is_completed() for work in self.works)

    def launch_cross(self, group: dist.ProcessGroup | None) -> None:
        """Reduce-scatter with several ZeRO groups: once the scatter is done, sum the slice across groups."""
        if self.phase != 1 or group is None or self._scatter_out is None:
            return
        self.wait()
        self.works.append(dist.all_reduce(self._scatter_out, group=group, async_op=True))
        self.phase = 2

    def finish(self, scatter: bool, take: Callable[[Bucket], torch.Tensor | None] | None = None) -> None:
        """Wait for the reduction and take its result in. All-reduce: the bucket holds it (and stays the
        base further local gradients are added to). Reduce-scatter: the slice is added to `shard_grads`
        and the bucket is emptied (what remains there is consumed; a transient bucket is freed).
        `take` (robust aggregation, after the wait): computes the result; returns the owned slice when
        `scatter`, else writes the whole bucket."""
        if self.phase == 0:
            return
        self.wait()
        self.phase = 0
        if take is not None:
            self._scatter_out = take(self)
        if not scatter:
            return
        assert self._scatter_out is not None
        if self.shard_grads is None:
            self.shard_grads, self._scatter_out = self._scatter_out, None
        else:
            self.shard_grads.add_(self._scatter_out)
        self.state = [EMPTY] * len(self.params)
        self._release_grads()

    def finish_gather(self, group: dist.ProcessGroup) -> None:
        """Hierarchical all-reduce, last step: wait for the slice's reduce-scatter (inside the node) and
        all-reduce (across nodes), then all-gather the node's slices back into the whole bucket, which
        then holds the average, as after an all-reduce."""
        if self.phase == 0:
            return
        self.wait()
        self.phase = 0
        assert self._scatter_out is not None
        _all_gather_single(self._ensure_grads(), self._scatter_out, group=group)

    def expose(self) -> None:
        """Set every parameter's `.grad` (upcast: `.main_grad`) to its view of the (reduced) bucket."""
        for i, (p, view) in enumerate(zip(self.params, self.views)):
            if self.upcast:
                p.grad, p.main_grad = None, view  # type: ignore[attr-defined]
            else:
                p.grad = view
            self.state[i] = EXPOSED

    def owned_grads(self) -> torch.Tensor:
        """This rank's slice of the reduced gradients (bucket coordinates `own`)."""
        if self.shard_grads is not None:
            return self.shard_grads
        lo, hi = self.own
        return self._ensure_grads()[lo:hi]

    def reset(self) -> None:
        """Forget all gradients (zero_grad); waits for reductions in flight first."""
        self.wait()
        for i, p in enumerate(self.params):
            p.grad = None
            if self.upcast:
                p.main_grad = None  # type: ignore[attr-defined]
            self.state[i] = EMPTY
        self.arrived = [False] * len(self.params)
        self.narrived = 0
        if self._scatter_out is None:
            self._scatter_out = self.shard_grads  # reuse the memory
        self.shard_grads = None
        self.phase = 0
        self.reduced = self.dirty = self.prepared = False
        self._release_grads()

    def zero_views(self) -> None:
        """zero_grad keeping the gradients as views: fill the bucket with zeros and expose it, so new
        local gradients accumulate into it in place (waits for reductions in flight first)."""
        self.wait()
        self._ensure_grads().zero_()
        self.arrived = [False] * len(self.params)
        self.narrived = 0
        self.phase = 0
        self.reduced = self.dirty = self.prepared = False
        self.expose()

    # ---- ZeRO parameters ------------------------------------------------------------------------------------

    def launch_gather(self, group: dist.ProcessGroup) -> None:
        """All-gather the parameters from the owners of each slice (after the optimizer step)."""
        assert self.data is not None
        lo, hi = self.own
        self.works.append(_all_gather_single(self.data, self.data[lo:hi].clone(), group=group, async_op=True))

    def nbytes(self) -> dict[str, int]:
        """Bytes this bucket holds now: full gradients, reduced gradient slice, flat parameters."""

        def nbytes(*tensors: torch.Tensor | None) -> int:
            return sum(t.numel() * t.element_size() for t in tensors if t is not None)

        return {
            "grads": nbytes(self.grads),
            "grad_slices": nbytes(self.shard_grads, self._scatter_out),
            "params": nbytes(self.data),
        }


def flat_buckets(
    groups: list[list[torch.nn.Parameter]],
    shards: Sequence[tuple[int, int]],
    grad_dtype: torch.dtype | None,
    divisor: int,
    *,
    zero: bool,
    transient: bool,
) -> list[Bucket]:
    """One Bucket per parameter group, each a slice of one flat gradient (and, under `zero`, data)
    buffer per (dtype, device), padded to a multiple of its number of shards (`shards`: per group, its
    number of shards and this rank's index); `transient` (ZeRO stage 2): no gradient buffer, each bucket
    allocates its own while reducing."""
    sizes = [-(-sum(p.numel() for p in b) // n) * n for b, (n, _) in zip(groups, shards)]
    totals: dict[tuple[torch.dtype, torch.device], int] = {}
    for b, size in zip(groups, sizes):
        totals[(b[0].dtype, b[0].device)] = totals.get((b[0].dtype, b[0].device), 0) + size

    def wide(dtype: torch.dtype) -> torch.dtype:
        if grad_dtype is None or torch.finfo(dtype).bits >= torch.finfo(grad_dtype).bits:
            return dtype
        return grad_dtype

    def flat(grad: bool) -> dict[tuple[torch.dtype, torch.device], torch.Tensor]:
        return {k: torch.zeros(n, dtype=wide(k[0]) if grad else k[0], device=k[1]) for k, n in totals.items()}

    grads = flat(grad=True) if not transient else {}
    data = flat(grad=False) if zero else {}
    used = dict.fromkeys(totals, 0)
    buckets: list[Bucket] = []
    for b, size, (nshards, index) in zip(groups, sizes, shards):
        key = (b[0].dtype, b[0].device)
        o, used[key] = used[key], used[key] + size
        g = grads[key][o : o + size] if grads else None
        d = data[key][o : o + size] if data else None
        bucket = Bucket(b, size, g, d, index, nshards, divisor, grad_dtype=wide(key[0]))
        if zero:
            bucket.adopt_data()
        buckets.append(bucket)
    return buckets
