"""Gradients across ranks: the bucketed (optionally overlapping, optionally ZeRO, optionally hierarchical) reducer."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nnscaler.runtime.grads.aggregation import RobustAggregation, build_aggregation
from nnscaler.runtime.grads.buckets import DEFAULT_BUCKET_CAP_MB, Bucket, flat_buckets, make_buckets
from nnscaler.runtime.grads.fault_inject import FaultInjector, from_env
from nnscaler.runtime.grads.grad_ops import (  # re-exported: their historical home
    average_gradients,
    first_holders,
    grad_sq_norm,
    param_grad,
    scale_grads,
    sq_norm_of,
)
from nnscaler.runtime.grads.hierarchy import Hierarchy, build_hierarchy
from nnscaler.runtime.grads.reducer_hooks import ReducerHooksMixin
from nnscaler.runtime.grads.sync_flags import reductions_skipped
from nnscaler.runtime.grads.zero_slices import ZeroPiece, zero_groups, zero_process_groups

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "Reducer",
    "ZeroPiece",
    "build_reducer",
    "zero_groups",
    "zero_process_groups",
    "make_buckets",
    "average_gradients",
    "param_grad",
    "grad_sq_norm",
    "first_holders",
    "scale_grads",
]


class Reducer(ReducerHooksMixin):
    """Averages gradients over the data-parallel group in buckets; optionally shards them (ZeRO).

    Buckets take parameters in reverse registration order (roughly the order backward produces
    gradients), up to `bucket_cap_mb` each. With `async_op`, a post-accumulate-grad hook moves each
    gradient into its bucket and launches the bucket's collective as soon as all of its gradients are
    in, overlapping communication with the rest of backward; at the end of the backward pass it waits
    for them and exposes the averaged gradients as `.grad` (as torch DDP; `settle_after_backward`), and
    `sync` reduces what is left. Without it, `sync` reduces every bucket (all launched, then all
    waited for) and `.grad` holds the local gradients until then.

    ZeRO (`zero_group` of S > 1 ranks, a consecutive part of the data-parallel group): every bucket
    is padded to a multiple of S, and rank i of the ZeRO group owns the i-th S-th of each. The
    parameters become views of flat `data` buffers so `gather_params` refreshes them with one
    all-gather per bucket. `scatter` reduces with reduce-scatter (then an all-reduce of the slice over
    `cross_group`, the ranks with the same index in the other ZeRO groups) instead of all-reduce.
    `stage` 2 also shards the gradients: reduce-scatter as soon as a bucket is full, and only the
    owned slice is kept (the full bucket is freed once reduced).

    `groups` (id of a parameter -> a group): parameters whose gradients are also partial sums over plan
    axes (weights held whole where their readers split the batch) get buckets of their own, each reduced
    with one collective over those axes' ranks of every replica (same divisor: the sum over the axes, then
    the replicas' mean); under ZeRO these buckets are sharded over that group. Not with robust aggregation
    or several ZeRO groups (the partition keeps `copy_to_group` for their weights then).

    `deferred` parameters (weights tied across pipeline stages, whose gradients are summed over the
    stages at the end of the step) get buckets of their own, after the others, without hooks: their
    `.grad` stays put through backward and they are reduced in `sync` only, after that sum.

    Collective order: every rank issues the collectives of all communicators (data-parallel, ZeRO,
    cross group) in one order fixed by the program (bucket launch order, itself the hook order, the
    same on every rank), never by which collective happens to be complete; NCCL requires it.

    `hierarchy` (runtime/hierarchy.py; not with ZeRO): each bucket is reduce-scattered inside the node,
    its slice all-reduced across nodes (the cross phase, issued at the next launch as under ZeRO), and
    all-gathered back when the bucket is taken in (`_drain` / `sync`: fixed points of the program).

    `grad_dtype` (e.g. fp32): the buckets of lower-precision parameters hold their gradients in this
    dtype and reduce them in it; the reduced gradients are then `param.main_grad` (see buckets.py).

    Reducer hooks (reducer_hooks.py) run once per step: while any is registered, backward launches
    nothing (as inside `no_sync`) except in train_step's last micro-batch (`defers`).

    `robust` (aggregation.py; not with a hierarchy or several ZeRO groups): a coordinate-wise rule
    replaces each bucket's collective; Zeno launches nothing in backward and weighs the buckets in
    `sync`. `fault` (fault_inject.py, a drill) corrupts this rank's buckets before they are reduced.
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
        stage: int = 1,
        grad_dtype: torch.dtype | None = None,
        deferred: Sequence[torch.nn.Parameter] = (),
        hierarchy: Hierarchy | None = None,
        robust: RobustAggregation | None = None,
        fault: FaultInjector | None = None,
        groups: dict[int, dist.ProcessGroup] | None = None,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(
                f"ZeRO stage {stage} is not supported by the reducer (1 or 2; 3 is zero3.Zero3Reducer)"
            )
        self._init_state(
            params,
            group,
            zero_group=zero_group,
            cross_group=cross_group,
            scatter=scatter,
            stage=stage,
            async_op=async_op,
            hierarchy=hierarchy,
        )
        split = zero_group if zero_group is not None else (self.hier.intra if self.hier else None)
        nshards = dist.get_world_size(split) if split is not None else 1
        index = dist.get_rank(split) if split is not None else 0
        late = {id(p) for p in deferred}
        extra = groups or {}
        if extra and (robust is not None or cross_group is not None):
            raise ValueError(
                "gradients summed over plan axes (Reducer groups) are not reduced under robust aggregation or "
                "zero_ngroups > 1: generate the module again with this ComputeConfig (it keeps copy_to_group)"
            )
        parts = make_buckets([p for p in self.params[::-1] if id(p) not in late], bucket_cap_mb, extra)
        nhooked = len(parts)
        parts += make_buckets([p for p in self.params[::-1] if id(p) in late], bucket_cap_mb, extra)
        self.robust, self.fault = robust, fault
        shards = [self._shards(extra.get(id(b[0])), nshards, index) for b in parts]
        self.buckets: list[Bucket] = flat_buckets(
            parts, shards, grad_dtype, self.grad_divisor, zero=self.zero, transient=self.stage >= 2
        )
        for bucket in self.buckets:
            bucket.group = extra.get(id(bucket.params[0]))
        self.upcast = any(b.upcast for b in self.buckets)
        """Some gradients are kept wider than their parameters (in `.main_grad`, see buckets.py)."""
        if self.async_op:
            for bucket in self.buckets[:nhooked]:
                for i, p in enumerate(bucket.params):
                    self._hooks.append(
                        p.register_post_accumulate_grad_hook(partial(self._on_grad, bucket, i))
                    )
        self.pieces: list[ZeroPiece] = []
        for bucket in self.buckets if self.zero else []:
            assert bucket.data is not None
            for i, start, end in bucket.own_pieces():
                o = bucket.offsets[i] + start
                view = nn.Parameter(bucket.data[o : o + end - start], requires_grad=True)
                self.pieces.append(ZeroPiece(bucket.params[i], view, start, end, bucket, o))

    def _init_state(
        self,
        params: Sequence[torch.nn.Parameter],
        group: dist.ProcessGroup,
        *,
        zero_group: dist.ProcessGroup | None,
        cross_group: dist.ProcessGroup | None,
        scatter: bool,
        stage: int,
        async_op: bool,
        hierarchy: Hierarchy | None,
    ) -> None:
        """The fields every reducer has (this one and zero3.Zero3Reducer, which makes its own buckets)."""
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.dp_size = dist.get_world_size(group)
        self.grad_divisor = self.dp_size
        """Gradients are divided by this before they are summed over the replicas: the data-parallel size
        (a mean), or 1 (a sum, nnScaler's convention: `ComputeConfig.dp_grad_reduction='sum'`)."""
        self.zero_group = zero_group
        self.cross_group = cross_group
        self.zero = zero_group is not None
        self.stage = stage if self.zero else 0
        self.scatter = self.zero and (scatter or self.stage >= 2)
        self.async_op = async_op or self.stage >= 2
        self.hier = hierarchy if not self.zero else None
        """Hierarchical all-reduce (runtime/hierarchy.py): buckets are reduce-scattered inside the node,
        their slices all-reduced across nodes (the cross phase), then all-gathered back."""
        self.enabled = True
        """False inside `no_sync`: hooks collect gradients but launch nothing."""
        self.settle_after_backward = True
        """Async: at the end of each backward pass (outside `no_sync`) wait for the reductions it
        launched and expose the averaged gradients as `.grad`, as torch DDP does; `train_step` turns it
        off (the schedule's later work overlaps them; its final `sync` waits)."""
        self._in_pass = False
        self._queue: list[Bucket] = []
        """Buckets launched and not yet taken in, in launch order."""
        self._hooks: list[Any] = []
        self.robust: RobustAggregation | None = None
        self.fault: FaultInjector | None = None
        self.round, self._fresh = 0, False
        """Aggregation rounds (syncs that reduced something) so far; whether one is under way."""

    def _shards(self, group: dist.ProcessGroup | None, nshards: int, index: int) -> tuple[int, int]:
        """(shards, this rank's index) of a bucket: under ZeRO a bucket of summed weights is sharded over
        its whole group (the plan axes x the replicas), the others over the ZeRO group."""
        if group is None or not self.zero:
            return nshards, index
        return dist.get_world_size(group), dist.get_rank(group)

    def set_grad_divisor(self, divisor: int) -> None:
        """Divide gradients by `divisor` before summing them over the replicas (1: nnScaler's sum)."""
        self.grad_divisor = divisor
        for bucket in self.buckets:
            bucket.divisor = divisor

    # ---- backward ------------------------------------------------------------------------------------

    def _prepare(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's local contribution (divided), corrupted first (once) under a fault drill."""
        fresh, grads = not bucket.prepared, bucket.prepare()
        if self.fault is not None and fresh:
            self.fault.corrupt(id(bucket), grads, self.round)
        if fresh:
            self._apply_pre_hooks(grads)  # nnScaler's reducer pre-hooks (reducer_hooks.py)
        return grads

    def _launch(self, bucket: Bucket) -> None:
        self._prepare(bucket)
        self._fresh = True
        if bucket.group is not None:  # summed over plan axes too: over them and the replicas at once
            bucket.launch(bucket.group, self.scatter)
        elif self.robust is not None and self.robust.coords is not None:
            bucket.launch(self.group, self.scatter, start=self.robust.coords.start)
        elif self.hier is not None:
            bucket.launch(self.hier.intra, scatter=True)
        else:
            group = self.zero_group if self.scatter else self.group
            assert group is not None
            bucket.launch(group, self.scatter)
        self._queue.append(bucket)

    def _cross(self) -> dist.ProcessGroup | None:
        if self.hier is not None:
            return self.hier.inter
        return self.cross_group if self.scatter else None

    def _finish(self, bucket: Bucket) -> None:
        if bucket.group is not None:
            bucket.finish(self.scatter)
        elif self.robust is not None and self.robust.coords is not None:
            bucket.finish(self.scatter, take=self.robust.coords.take)
        elif self.hier is not None:
            bucket.finish_gather(self.hier.intra)
        else:
            bucket.finish(self.scatter)
        self._apply_post_hooks([bucket])  # nnScaler's reducer post-hooks (reducer_hooks.py)

    def _drain(self, until: Bucket) -> None:
        """Finish the launched buckets up to `until`, in launch order (the order every rank shares, so
        cross-group collectives are issued alike everywhere)."""
        while self._queue:
            bucket = self._queue.pop(0)
            bucket.launch_cross(self._cross())
            self._finish(bucket)
            if bucket is until:
                return

    def _reap(self) -> None:
        """Stage 2 / 3, right after a launch: start the cross-group sum of every earlier bucket (waiting
        for its reduce-scatter: a fixed point in program order, so every rank issues the collectives
        of both communicators in one order), then take in (and free), in launch order, the buckets
        whose collectives are over. Completion decides only what is freed now, never what is issued."""
        cross = self._cross()
        if cross is not None:
            for bucket in self._queue[:-1]:
                bucket.launch_cross(cross)  # no-op once launched
        if self.hier is not None:
            return  # taking a bucket in issues its all-gather: only at fixed points (_drain, sync)
        while self._queue and self._queue[0].done():
            bucket = self._queue[0]
            if bucket.phase == 1 and cross is not None:
                return  # the newest bucket: its cross-group sum starts at the next launch or in sync
            self._finish(bucket)
            self._queue.pop(0)

    @torch.no_grad()
    def _on_grad(self, bucket: Bucket, i: int, param: torch.Tensor) -> None:
        if bucket.phase:  # an earlier backward's reduction (no sync in between): finish it first
            self._drain(until=bucket)
        if not self._in_pass:
            self._in_pass = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        zeno = self.robust is not None and self.robust.zeno is not None  # scores first, in sync
        launch = self.enabled and not reductions_skipped() and not zeno
        if bucket.accept(i) and launch and not self._defer():
            self._launch(bucket)
            if self.stage >= 2 or self.hier is not None:
                self._reap()

    def _end_pass(self) -> None:
        self._in_pass = False
        for bucket in self.buckets:
            bucket.arrived = [False] * len(bucket.params)
            bucket.narrived = 0

    @torch.no_grad()
    def _end_backward(self) -> None:
        """End of a backward pass (an autograd callback). With `settle_after_backward`, outside
        `no_sync`, under all-reduce: wait for the buckets this pass launched (in launch order) and make
        `.grad` their averaged values, so code between backward and the step sees synced gradients."""
        self._end_pass()
        if (
            not (self.enabled and self.settle_after_backward and self._queue)
            or self.scatter
            or reductions_skipped()
        ):
            return
        launched = list(self._queue)
        self._drain(until=launched[-1])
        for bucket in launched:
            bucket.expose()

    # ---- synchronisation -----------------------------------------------------------------------------

    @torch.no_grad()
    def sync(self) -> None:
        """Finish reducing every bucket: launch those not launched by hooks, wait for all.

        Afterwards (all-reduce) each parameter's `.grad` is its view of the averaged bucket;
        (reduce-scatter) the parameters have no `.grad` and `ZeroPiece.grad()` is the averaged slice.
        """
        pending = [b for b in self.buckets if not b.reduced or b.dirty]
        if self.robust is not None:
            self.robust.before_launch(self._prepare, pending)  # Zeno: score, then weigh the buckets
        for bucket in pending:
            self._launch(bucket)
        for bucket in self._queue:  # launch order
            bucket.launch_cross(self._cross())
        for bucket in self._queue:
            self._finish(bucket)
        self._queue = []
        if self._fresh and self.robust is not None:
            self.robust.end_round()
        self.round, self._fresh = self.round + self._fresh, False
        for bucket in self.buckets:
            if not self.scatter:
                bucket.expose()
            bucket.reduced = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop all gradients (waits for reductions in flight). `set_to_none=False` under all-reduce:
        zero the buckets instead (one fill per bucket) and keep `.grad` (or `.main_grad`) their views,
        so backward accumulates straight into the buckets (torch DDP's gradient_as_bucket_view)."""
        for bucket in self.buckets:
            if set_to_none or self.scatter or bucket.transient:
                bucket.reset()
            else:
                bucket.zero_views()
        self._queue = []
        self._end_pass()

    @torch.no_grad()
    def gather_params(self) -> None:
        """ZeRO: all-gather every bucket's parameters from the owners of its slices (after a step)."""
        if not self.zero:
            return
        assert self.zero_group is not None
        for bucket in self.buckets:
            bucket.launch_gather(bucket.group or self.zero_group)
        for bucket in self.buckets:
            bucket.wait()

    # ---- norms and clipping under ZeRO ----------------------------------------------------------------

    def owned_sq_norm(self, params: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        """ZeRO: squared 2-norm of the reduced gradients of `params` over the ZeRO group (this rank
        holds its slice of them; the slices of the group are summed). The buckets of weights summed over
        plan axes are sharded over their own group (plan axes x replicas): their slices are summed over
        it, and counted where `params` holds their weights (one plan device of the group, as for every
        weight held by several plan devices)."""
        wanted = {id(p) for p in params}
        plain = [pc.grad() for pc in self.pieces if pc.bucket.group is None and id(pc.source) in wanted]
        total = sq_norm_of(plain, device)
        dist.all_reduce(total, group=self.zero_group)
        groups = list({id(b.group): b.group for b in self.buckets if b.group is not None}.values())
        for group in groups:  # bucket order: the same on every rank of each group
            part = sq_norm_of([pc.grad() for pc in self.pieces if pc.bucket.group is group], device)
            dist.all_reduce(part, group=group)
            held = {id(p) in wanted for b in self.buckets if b.group is group for p in b.params}
            if held == {True}:
                total += part
            elif held != {False}:
                raise RuntimeError("owned_sq_norm: the weights sharing one reduction group are owned apart")
        return total

    @torch.no_grad()
    def scale_owned(self, coef: torch.Tensor) -> None:
        """ZeRO: multiply this rank's slice of the reduced gradients (what its optimizer reads) by `coef`."""
        for bucket in self.buckets:
            owned = bucket.owned_grads()
            owned.mul_(coef.to(owned.device, owned.dtype))

    # ---- bookkeeping -----------------------------------------------------------------------------------

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
        return all((b.params[0].dtype, b.params[0].device) == b.kind for b in self.buckets)

    def nbytes(self) -> dict[str, int]:
        """Bytes held now by the buckets: full gradients, reduced gradient slices, flat parameters."""
        total: dict[str, int] = {}
        for bucket in self.buckets:
            for k, v in bucket.nbytes().items():
                total[k] = total.get(k, 0) + v
        return total

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


def build_reducer(
    params: Sequence[torch.nn.Parameter],
    dp_group: dist.ProcessGroup | None,
    *,
    rank: int,
    world_size: int,
    plan_ngpus: int,
    config: Any,
    deferred: Sequence[torch.nn.Parameter] = (),
    bucket_cap_mb: float | None = None,
    groups: dict[int, dist.ProcessGroup] | None = None,
) -> Reducer | None:
    """The reducer of a ParallelModule from its `compute_config` (None: defaults); None with one replica.

    Reads `reducer_bucket_cap_mb`, `use_async_reducer`, `use_zero`, `zero_ngroups`,
    `zero_use_reduce_scatter` and (when present) `zero_stage` and `reduce_grads_in_fp32`. Under ZeRO it
    creates the ZeRO groups of every data-parallel group: every rank must build its reducers at the
    same point, in the same order. `deferred`, `groups`: see `Reducer`.
    """
    if dp_group is None:
        from_env(rank, world_size=world_size, replicas=False)  # refuses a fault drill that cannot fire
        return None
    zero_group = cross_group = None
    stage = 1
    if config is not None and config.use_zero:
        stage = getattr(config, "zero_stage", 1)
        if stage not in (1, 2):
            raise ValueError(
                f"ComputeConfig.zero_stage={stage!r}: build_reducer implements ZeRO stages 1 and 2 "
                "(stage 3 is built by ParallelModule with nnscaler.runtime.grads.zero3.build_zero3)"
            )
        zero_group, cross_group = zero_process_groups(rank, world_size, plan_ngpus, config.zero_ngroups)
    summed = getattr(config, "dp_grad_reduction", "mean") == "sum"
    scatter = config is not None and (config.zero_use_reduce_scatter or (config.use_zero and stage >= 2))
    robust = build_aggregation(config, dp_group, scatter and zero_group is not None)
    cap = bucket_cap_mb if bucket_cap_mb is not None else getattr(config, "reducer_bucket_cap_mb", None)
    cap = DEFAULT_BUCKET_CAP_MB if cap is None else cap
    hierarchy = None
    if zero_group is None and robust is None:
        hierarchy = build_hierarchy(rank, world_size, plan_ngpus, config, bucket_bytes=cap * 2**20)
    reducer = Reducer(
        params,
        dp_group,
        bucket_cap_mb=cap,
        async_op=config is not None and config.use_async_reducer,
        zero_group=zero_group,
        cross_group=cross_group,
        scatter=config is not None and config.zero_use_reduce_scatter,
        stage=stage,
        grad_dtype=torch.float32 if getattr(config, "reduce_grads_in_fp32", False) else None,
        deferred=deferred,
        hierarchy=hierarchy,
        robust=robust,
        fault=from_env(rank, world_size=world_size),
        groups=groups,
    )
    if summed:
        reducer.set_grad_divisor(1)
    return reducer
