"""Gradients across ranks: the bucketed (optionally overlapping, optionally ZeRO) reducer, norms, clipping."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from nnscaler.runtime.buckets import Bucket

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "Reducer",
    "ZeroPiece",
    "make_buckets",
    "average_gradients",
    "grad_sq_norm",
    "first_holders",
    "scale_grads",
]

DEFAULT_BUCKET_CAP_MB = 25.0
"""Bucket size when `ComputeConfig.reducer_bucket_cap_mb` is None (torch DDP's default)."""


def make_buckets(params: Sequence[torch.Tensor], cap_mb: float | None) -> list[list[torch.Tensor]]:
    """Split `params` (in order) into buckets of one dtype and device, each at most `cap_mb` MB.

    A parameter larger than the cap gets a bucket of its own; `cap_mb == 0` gives one bucket per tensor.
    """
    cap = int((DEFAULT_BUCKET_CAP_MB if cap_mb is None else cap_mb) * 1024 * 1024)
    open_buckets: dict[tuple[torch.dtype, torch.device], tuple[list[torch.Tensor], int]] = {}
    buckets: list[list[torch.Tensor]] = []
    for p in params:
        key = (p.dtype, p.device)
        nbytes = p.numel() * p.element_size()
        bucket, size = open_buckets.get(key, ([], 0))
        if bucket and size + nbytes > cap:
            buckets.append(bucket)
            bucket, size = [], 0
        bucket.append(p)
        open_buckets[key] = (bucket, size + nbytes)
    buckets.extend(b for b, _ in open_buckets.values() if b)
    return buckets


def average_gradients(
    params: Sequence[torch.Tensor], group: dist.ProcessGroup | None, cap_mb: float | None = None
) -> None:
    """Average the gradients of `params` over `group` in place (no-op when `group` is None).

    Parameters without a gradient get zeros first, so every rank sends the same bucket layout.
    All buckets are reduced asynchronously, then waited for.
    """
    if group is None:
        return
    size = dist.get_world_size(group)
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif p.grad.is_sparse:
            raise NotImplementedError("sparse gradients are not supported by the gradient reducer")
    pending = []
    for bucket in make_buckets(params, cap_mb):
        grads = [p.grad for p in bucket]
        flat = _flatten_dense_tensors(grads)
        pending.append((dist.all_reduce(flat, group=group, async_op=True), flat, grads))
    for work, flat, grads in pending:
        work.wait()
        flat.div_(size)
        for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(synced)


def grad_sq_norm(params: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """Sum of squared gradient entries of `params` (fp32 scalar; parameters without grad count 0)."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if p.grad is not None:
            total = total + p.grad.detach().float().pow(2).sum().to(total.device)
    return total


def first_holders(keys: Sequence[Hashable], group: dist.ProcessGroup | None) -> list[bool]:
    """For each of this rank's `keys`: is this rank the lowest in `group` holding the same key?

    Keys name tensor pieces (e.g. original name and shard); used so that a piece replicated on
    several ranks is counted once in a norm. Collective over `group` (all-gather of the keys).
    """
    if group is None:
        return [True] * len(keys)
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, list(keys), group=group)
    owner: dict[Hashable, int] = {}
    for r, rank_keys in enumerate(everyone):
        for k in rank_keys:
            owner.setdefault(k, r)
    me = dist.get_rank(group)
    return [owner[k] == me for k in keys]


def scale_grads(params: Sequence[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale gradients by `min(1, max_norm / (total_norm + 1e-6))`, as `torch.nn.utils.clip_grad_norm_`."""
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.detach().mul_(coef.to(p.grad.device, p.grad.dtype))


@dataclass(frozen=True, eq=False)
class ZeroPiece:
    """One parameter's part of this rank's ZeRO slice: an optimizer parameter viewing the flat buffer."""

    source: torch.nn.Parameter
    """The module's parameter."""
    param: torch.nn.Parameter
    """What the optimizer updates: elements `[start, end)` of the flattened `source`, sharing memory."""
    start: int
    end: int
    bucket: Bucket
    offset: int
    """Where the piece starts in the bucket."""

    def grad(self) -> torch.Tensor:
        """The reduced gradient of the piece (after `Reducer.sync`)."""
        lo = self.bucket.own[0]
        owned = self.bucket.owned_grads()
        return owned[self.offset - lo : self.offset - lo + self.end - self.start]


class Reducer:
    """Averages gradients over the data-parallel group in buckets; optionally shards them for ZeRO.

    Buckets take parameters in reverse registration order (roughly the order backward produces
    gradients), up to `bucket_cap_mb` each. With `async_op`, a post-accumulate-grad hook moves each
    gradient into its bucket and launches the bucket's collective as soon as all of its gradients are
    in, overlapping communication with the rest of backward; `sync` waits for them (and reduces what
    is left). Without it, `sync` reduces every bucket (all launched, then all waited for).

    ZeRO (`zero_group` of S > 1 ranks, a consecutive part of the data-parallel group): every bucket
    is padded to a multiple of S, and rank i of the ZeRO group owns the i-th S-th of each. The
    parameters become views of flat `data` buffers so `gather_params` refreshes them with one
    all-gather per bucket. `scatter` reduces with reduce-scatter (then an all-reduce of the slice over
    `cross_group`, the ranks with the same index in the other ZeRO groups) instead of all-reduce.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        group: dist.ProcessGroup,
        *,
        bucket_cap_mb: float | None = None,
        async_op: bool = False,
        zero_group: dist.ProcessGroup | None = None,
        cross_group: dist.ProcessGroup | None = None,
        scatter: bool = False,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.dp_size = dist.get_world_size(group)
        self.zero_group = zero_group
        self.cross_group = cross_group
        self.zero = zero_group is not None
        self.scatter = self.zero and scatter
        nshards = dist.get_world_size(zero_group) if zero_group is not None else 1
        index = dist.get_rank(zero_group) if zero_group is not None else 0
        self.async_op = async_op
        self.enabled = True
        """False inside `no_sync`: hooks collect gradients but launch nothing."""
        self._in_pass = False
        self.buckets: list[Bucket] = []
        groups = make_buckets(self.params[::-1], bucket_cap_mb)
        sizes = [-(-sum(p.numel() for p in b) // nshards) * nshards for b in groups]
        by_kind: dict[tuple[torch.dtype, torch.device], int] = {}
        for b, size in zip(groups, sizes):
            key = (b[0].dtype, b[0].device)
            by_kind[key] = by_kind.get(key, 0) + size
        grads = {k: torch.zeros(n, dtype=k[0], device=k[1]) for k, n in by_kind.items()}
        data = {k: torch.zeros(n, dtype=k[0], device=k[1]) for k, n in by_kind.items()} if self.zero else {}
        used = dict.fromkeys(by_kind, 0)
        for b, size in zip(groups, sizes):
            key = (b[0].dtype, b[0].device)
            o = used[key]
            used[key] = o + size
            bucket = Bucket(
                b, grads[key][o : o + size], data[key][o : o + size] if data else None, index, nshards
            )
            if self.zero:
                bucket.adopt_data()
            self.buckets.append(bucket)
        self._hooks = []
        if async_op:
            for bucket in self.buckets:
                for i, p in enumerate(bucket.params):
                    self._hooks.append(
                        p.register_post_accumulate_grad_hook(partial(self._on_grad, bucket, i))
                    )
        self.pieces: list[ZeroPiece] = []
        if self.zero:
            for bucket in self.buckets:
                assert bucket.data is not None
                for i, start, end in bucket.own_pieces():
                    o = bucket.offsets[i] + start
                    view = nn.Parameter(bucket.data[o : o + end - start], requires_grad=True)
                    self.pieces.append(ZeroPiece(bucket.params[i], view, start, end, bucket, o))

    # ---- backward ------------------------------------------------------------------------------------

    @torch.no_grad()
    def _on_grad(self, bucket: Bucket, i: int, param: torch.Tensor) -> None:
        if bucket.phase:  # an earlier backward's reduction (no sync in between): finish it first
            bucket.launch_cross(self.cross_group if self.scatter else None)
            bucket.finish(self.scatter)
        if not self._in_pass:
            self._in_pass = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_pass)
        if bucket.accept(i) and self.enabled:
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        group = self.zero_group if self.scatter else self.group
        assert group is not None
        bucket.launch(group, self.dp_size, self.scatter)

    def _end_pass(self) -> None:
        self._in_pass = False
        for bucket in self.buckets:
            bucket.arrived = [False] * len(bucket.params)
            bucket.narrived = 0

    # ---- synchronisation -----------------------------------------------------------------------------

    @torch.no_grad()
    def sync(self) -> None:
        """Finish reducing every bucket: launch those not launched by hooks, wait for all.

        Afterwards (all-reduce) each parameter's `.grad` is its view of the averaged bucket;
        (reduce-scatter) the parameters have no `.grad` and `ZeroPiece.grad()` is the averaged slice.
        """
        for bucket in self.buckets:
            if not bucket.reduced or bucket.dirty:
                self._launch(bucket)
        if self.scatter and self.cross_group is not None:
            for bucket in self.buckets:
                bucket.launch_cross(self.cross_group)
        for bucket in self.buckets:
            bucket.finish(self.scatter)
            if not self.scatter:
                bucket.expose()
            bucket.reduced = False

    def zero_grad(self) -> None:
        """Drop all gradients (waits for reductions in flight)."""
        for bucket in self.buckets:
            bucket.reset()
        self._end_pass()

    @torch.no_grad()
    def gather_params(self) -> None:
        """ZeRO: all-gather every bucket's parameters from the owners of its slices (after a step)."""
        if not self.zero:
            return
        assert self.zero_group is not None
        for bucket in self.buckets:
            bucket.launch_gather(self.zero_group)
        for bucket in self.buckets:
            bucket.wait()

    def check(self) -> None:
        """Raise if the parameters were moved or replaced since the reducer was built (ZeRO)."""
        if self.zero and not all(b.owns_data() for b in self.buckets):
            raise RuntimeError(
                "the parameters of a ZeRO ParallelModule were moved or replaced (e.g. by module.to()) "
                "after its optimizer was built; move the module first, then call build_optimizer"
            )

    def valid_for(self, params: Sequence[torch.nn.Parameter]) -> bool:
        """Whether the reducer still matches `params` (same objects, dtypes and devices)."""
        mine = [p for p in params if p.requires_grad]
        if len(mine) != len(self.params) or any(a is not b for a, b in zip(mine, self.params)):
            return False
        return all(
            b.params[0].dtype == b.grads.dtype and b.params[0].device == b.grads.device for b in self.buckets
        )

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


def zero_groups(dp_ranks: Sequence[int], ngroups: int) -> tuple[list[list[int]], list[list[int]]]:
    """nnScaler's ZeRO groups of one data-parallel group: `ngroups` consecutive parts (optimizer state
    is sharded within each) and the cross groups (the ranks with the same index in every part).

    E.g. ranks [0, 2, 4, 6] with 2 groups: parts [0, 2], [4, 6]; cross groups [0, 4], [2, 6].
    """
    n = len(dp_ranks)
    if ngroups < 1 or n % ngroups != 0:
        raise ValueError(
            f"ComputeConfig.zero_ngroups={ngroups} must divide the data-parallel size {n} (ranks {list(dp_ranks)})"
        )
    size = n // ngroups
    parts = [list(dp_ranks[k * size : (k + 1) * size]) for k in range(ngroups)]
    cross = [list(dp_ranks[j::size]) for j in range(size)]
    return parts, cross
