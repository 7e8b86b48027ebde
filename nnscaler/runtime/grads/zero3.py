"""ZeRO stage 3: every rank keeps 1/S of each parameter; blocks are gathered just in time.

The parameters of a ParallelModule are grouped into blocks by the module path of their original
names up to the first layer index (`transformer.h.0`, the rule of codegen's sections; `block_of`).
Within a block, the parameters of one dtype / device / requires_grad lie back to back in a flat
buffer padded to a multiple of the ZeRO group size S (a `Flat`), and rank i of the ZeRO group keeps
elements [i*size/S, (i+1)*size/S) of it (`shard`), like the slices of stages 1 and 2. The module's
registered parameters stay (same objects, shapes and dtypes, so optimizers and names keep working)
but hold no data: each is a one-element tensor expanded to its shape (it reads as zeros).

Forward. The generated code reads `self.<local_name>`; `ParallelModule.__getattr__` asks `fetch`,
which all-gathers the parameter's whole block on its first access (one collective per flat buffer,
straight into the buffer the parameters view: no copies), starts the gathers of the next
`zero3_prefetch_blocks` blocks in the order recorded during the first forward (async, so they run while
this block computes), drops the blocks before, and hands out a view of the gathered buffer made by
`Unshard`, an autograd Function. The all-gathers run on a twin of the ZeRO group (on NCCL a
communicator, hence a stream, of their own), so a prefetch never queues behind a reduce-scatter.
Around forward (the module's forward hooks) a `saved_tensors_hooks` pair replaces every tensor saved
for backward that views a gathered buffer by a small token (`Saved`), so nothing keeps the full
parameters alive after their block; at the end of forward every gathered block is dropped but the
last, which backward needs first.

Backward. Unpacking a token gathers its block again and starts gathering the blocks before it in
forward order that backward will need (backward prefetch, as deep as in forward); when the last token of a buffer dies,
backward is done with it and it is dropped. `Unshard`'s backward adds the gradient, divided by the
data-parallel size, to the parameter's place in the flat buffer's gradient `Bucket` (the registered
parameter gets no `.grad`); once every use of every parameter of the buffer has delivered its
gradient, the bucket is reduce-scattered over the ZeRO group (async; then all-reduced over the cross
group with several ZeRO groups) and only this rank's averaged slice is kept. At most
`MAX_REDUCTIONS_IN_FLIGHT` full gradient buffers wait for their reduce-scatter. The gradient side
(`sync`, `no_sync`, `zero_grad`, `owned_sq_norm`, `scale_owned`, the optimizer's `pieces`) is the
stage-2 `Reducer`'s, and `ZeroOptimizer` steps the slices as in stage 2.

Outside forward (a recomputed region in backward, or forward called without `__call__`) `fetch`
gathers without the prefetch / drop policy; such blocks are dropped when backward ends or at the step.

State dicts gather: `full_tensors` rebuilds every full local tensor (collective over the ZeRO group),
so `state_dict()` looks like stage 1/2's and `merge_state_dicts` is unchanged; loading (`write`)
copies this rank's slice of each full local tensor into `shard`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nnscaler.mesh import ParallelDims
from nnscaler.runtime.comm import _all_gather_single
from nnscaler.runtime.dist.groups import create_twin_groups, get_twin_group
from nnscaler.runtime.dist.store_sync import reach
from nnscaler.runtime.grads.buckets import Bucket
from nnscaler.runtime.grads.reducer import (
    DEFAULT_BUCKET_CAP_MB,
    Reducer,
    ZeroPiece,
    zero_process_groups,
)
from nnscaler.runtime.grads.sync_flags import reductions_skipped
from nnscaler.runtime.grads.zero3_blocks import Block, Flat, Saved, Unshard, block_of

__all__ = ["Zero3Reducer", "build_zero3", "block_of"]

_increment_version = getattr(torch.autograd.graph, "increment_version", None)

MAX_REDUCTIONS_IN_FLIGHT = 1
"""Backward waits for older reduce-scatters beyond this many (each holds a block's full gradients)."""


class Zero3Reducer(Reducer):
    """ZeRO stage 3 for one ParallelModule: sharded parameters, just-in-time gathers, sharded gradients.

    A `Reducer` (stage 3, reduce-scatter, async) whose buckets are the flat buffers of the blocks, so
    the gradient side (`sync`, `no_sync`, `zero_grad`, `owned_sq_norm`, `scale_owned`, `pieces`) is the
    stage-2 one. `named` lists `(local name, original name, parameter)` in registration order.
    """

    def __init__(
        self,
        named: Sequence[tuple[str, str, nn.Parameter]],
        group: dist.ProcessGroup,
        zero_group: dist.ProcessGroup,
        cross_group: dist.ProcessGroup | None,
        *,
        grad_dtype: torch.dtype | None = None,
        gather_group: dist.ProcessGroup | None = None,
        prefetch: int = 1,
    ) -> None:
        # the Reducer's fields (its buckets are made here, from blocks, not by size)
        self._init_state(
            [p for _, _, p in named],
            group,
            zero_group=zero_group,
            cross_group=cross_group,
            scatter=True,
            stage=3,
            async_op=True,
            hierarchy=None,
        )
        self.settle_after_backward = False  # reduce-scatter: gradients are slices, never `.grad`
        self.gather_group = gather_group if gather_group is not None else zero_group
        """The ZeRO group's twin the parameter all-gathers run on: on NCCL a communicator of their own,
        so a prefetch does not queue behind the reduce-scatters of the blocks backward finished."""
        self.prefetch = prefetch
        """Blocks gathered ahead of the current one, in forward and in backward."""
        nshards, index = dist.get_world_size(zero_group), dist.get_rank(zero_group)

        blocks: dict[str, Block] = {}
        groups: dict[tuple[str, torch.dtype, torch.device, bool], list[tuple[str, nn.Parameter]]] = {}
        for local, original, p in named:
            block = blocks.setdefault(block_of(original), Block(block_of(original)))
            groups.setdefault((block.name, p.dtype, p.device, p.requires_grad), []).append((local, p))
        self.blocks = list(blocks.values())
        self.flats: list[Flat] = []
        self._where: dict[str, tuple[Flat, int]] = {}
        """Local name -> (flat buffer, index in it)."""
        for (name, *_), members in groups.items():
            flat = Flat(blocks[name], [n for n, _ in members], [p for _, p in members], nshards, index)
            flat.owner = self
            blocks[name].flats.append(flat)
            self.flats.append(flat)
            self._where.update((n, (flat, i)) for i, (n, _) in enumerate(members))

        self.buckets, self.pieces = self._block_buckets(nshards, index, grad_dtype)
        self.upcast = any(b.upcast for b in self.buckets)

        # the registered parameters keep shape, dtype and identity but no data
        self._placeholders: list[tuple[nn.Parameter, int]] = []
        for _, _, p in named:
            p.data = torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)
            self._placeholders.append((p, p.data_ptr()))

        self._order: list[Block] = []
        """Blocks in the order the first forward switched to them (prefetch follows it)."""
        self._recorded = False
        self._recording = False
        self._current: Block | None = None
        self._pos = -1
        """Index in `_order` of the current block in forward."""
        self._bpos = 0
        """Index in `_order` of the block backward is in."""
        self._bwd_current: Block | None = None
        self._by_ptr: dict[int, Flat] = {}
        """Data pointer of each gathered buffer -> its flat buffer (to recognise saved tensors)."""
        self._hooks_ctx: Any = None
        self._depth = 0

    def _block_buckets(
        self, nshards: int, index: int, grad_dtype: torch.dtype | None
    ) -> tuple[list[Bucket], list[ZeroPiece]]:
        """A gradient bucket per flat buffer that needs gradients, and this rank's pieces of each."""

        def wide(dtype: torch.dtype) -> torch.dtype:
            if grad_dtype is None or torch.finfo(dtype).bits >= torch.finfo(grad_dtype).bits:
                return dtype
            return grad_dtype

        buckets: list[Bucket] = []
        pieces: list[ZeroPiece] = []
        for flat in self.flats:
            if not flat.requires_grad:
                continue
            bucket = Bucket(
                flat.params, flat.size, None, None, index, nshards, self.grad_divisor, wide(flat.dtype)
            )
            flat.bucket = bucket
            buckets.append(bucket)
            for i, start, end in bucket.own_pieces():
                o = bucket.offsets[i] + start
                view = nn.Parameter(flat.shard[o - flat.lo : o - flat.lo + end - start], requires_grad=True)
                pieces.append(ZeroPiece(flat.params[i], view, start, end, bucket, o))
        return buckets, pieces

    # ---- gathering -----------------------------------------------------------------------------------

    def _gather(self, block: Block) -> None:
        """Start all-gathering the flat buffers of `block` that are not gathered (async)."""
        for flat in block.flats:
            if flat.full is None:
                flat.full = torch.empty(flat.size, dtype=flat.dtype, device=flat.device)
                flat.work = _all_gather_single(flat.full, flat.shard, group=self.gather_group, async_op=True)
                self._by_ptr[flat.full.data_ptr()] = flat

    @staticmethod
    def _wait(flat: Flat) -> None:
        if flat.work is not None:
            flat.work.wait()
            flat.work = None

    def _release(self, flat: Flat) -> None:
        if flat.full is not None:
            self._wait(flat)
            self._by_ptr.pop(flat.full.data_ptr(), None)
            flat.full = None

    def release_all(self) -> None:
        """Drop every gathered buffer (waits for gathers in flight)."""
        for flat in list(self._by_ptr.values()):
            self._release(flat)
        self._current = None

    def live_blocks(self) -> list[str]:
        """Names of the blocks gathered now (or being gathered)."""
        return [b.name for b in self.blocks if b.gathered]

    # ---- forward -------------------------------------------------------------------------------------

    def begin_forward(self) -> None:
        """Before the module's forward: record the block order (first time), recognise saved tensors."""
        self._depth += 1
        if self._depth > 1:
            return
        self._recording = not self._recorded
        self._current, self._pos = None, -1
        self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks_ctx.__enter__()

    def end_forward(self) -> None:
        """After the module's forward (also when it raised): drop every gathered block but the last one
        when backward will need it (tensors saved for backward view it): backward starts there."""
        self._depth -= 1
        if self._depth > 0:
            return
        if self._hooks_ctx is not None:
            self._hooks_ctx.__exit__(None, None, None)
            self._hooks_ctx = None
        if self._recording:
            self._recorded, self._recording = True, False
        self._bpos, self._bwd_current = len(self._order), None
        last = self._current
        keep = last is not None and any(f.tokens for f in last.flats)
        for flat in list(self._by_ptr.values()):
            if not (keep and flat.block is last):
                self._release(flat)
        self._current = None

    def fetch(self, name: str) -> torch.Tensor | None:
        """The full local tensor of parameter `name` for forward (None: not a sharded parameter)."""
        where = self._where.get(name)
        if where is None:
            return None
        flat, i = where
        if self._depth == 0:  # outside forward (recomputation in backward, forward called directly)
            if flat.full is None:
                self._gather(flat.block)  # kept until backward is done with it or the next step
        elif flat.block is not self._current or flat.full is None:
            self._enter(flat.block)
        self._wait(flat)
        if flat.requires_grad and torch.is_grad_enabled():
            if self._depth:  # a recomputed forward's graph is not backpropagated
                flat.uses[i] += 1
            return Unshard.apply(flat.params[i], self, flat, i)
        return flat.view(i)

    def _enter(self, block: Block) -> None:
        """Switch forward to `block`: gather it, prefetch the next one, drop the others."""
        if self._recording:
            self._order.append(block)
        order, nxt = self._order, self._pos + 1
        if nxt < len(order) and order[nxt] is block:
            self._pos = nxt
        else:
            self._pos = next((k for k, b in enumerate(order) if b is block), -1)
        ahead = (
            order[self._pos + 1 : self._pos + 1 + self.prefetch]
            if self._pos >= 0 and not self._recording
            else []
        )
        for flat in list(self._by_ptr.values()):  # the gathered ones
            if flat.block is not block and flat.block not in ahead:
                self._release(flat)
        self._gather(block)
        for nxt in ahead:  # in order: the nearest first
            self._gather(nxt)
        self._current = block

    # ---- saved tensors ---------------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> Any:
        if self._by_ptr and t.layout is torch.strided and not t.is_meta:
            try:
                flat = self._by_ptr.get(t.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):  # a tensor without storage (subclass, functional)
                return t
            if flat is not None and t.dtype == flat.dtype:
                return Saved(flat, t)
        return t

    def _unpack(self, saved: Any) -> torch.Tensor:
        if type(saved) is not Saved:
            return saved
        flat = saved.flat
        if flat.block is not self._bwd_current:  # backward reached another block
            self._bwd_current = flat.block
            self._gather(flat.block)
            self._prefetch_backward(flat.block)
        elif flat.full is None:
            self._gather(flat.block)
        self._wait(flat)
        assert flat.full is not None
        return flat.full.as_strided(saved.size, saved.stride, saved.offset)

    def _prefetch_backward(self, block: Block) -> None:
        """Backward gathers `block`: start gathering the block that ran before it in forward."""
        order = self._order
        k = next((k for k in range(min(self._bpos, len(order)) - 1, -1, -1) if order[k] is block), -1)
        if k < 0:
            k = next((k for k in range(len(order) - 1, -1, -1) if order[k] is block), -1)
        if k < 0:
            return
        self._bpos = k
        wanted = self.prefetch
        for before in order[k - 1 :: -1] if k > 0 and wanted else []:  # the next ones backward will need
            if before is not block and any(f.tokens for f in before.flats):
                self._gather(before)
                wanted -= 1
                if not wanted:
                    return

    def _done_with(self, flat: Flat) -> None:
        """The last saved tensor viewing `flat`'s gathered buffer is gone: outside forward, drop it."""
        if self._depth == 0:
            self._release(flat)

    # ---- gradients (the Reducer's, handed over by Unshard; and dropping what backward is done with) --

    @torch.no_grad()
    def _take(self, flat: Flat, i: int, grad: torch.Tensor) -> None:
        """Backward of one use of parameter `i` of `flat`: add `grad` (divided by the data-parallel size)
        to the bucket. Once every use of every parameter of the flat buffer has given its gradient, start
        the reduce-scatter and drop the gathered parameters."""
        bucket = flat.bucket
        assert bucket is not None
        if bucket.phase:  # an earlier backward's reduction (no sync in between): finish it first
            self._drain(until=bucket)
        if not self._in_pass:
            self._in_pass = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_pass)
        flat.uses[i] = max(flat.uses[i] - 1, 0)
        if not bucket.accept(i, grad, arrive=flat.uses[i] == 0):
            return
        if self.enabled and not reductions_skipped() and not self._defer():  # reducer hooks
            self._launch(bucket)
            self._reap()
            # bound the full gradient buffers in flight: take in the oldest reduce-scatters (in launch
            # order, the same on every rank) so that only the slices stay
            while len(self._queue) > MAX_REDUCTIONS_IN_FLIGHT:
                self._drain(until=self._queue[0])
        self._release(flat)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop all gradients, including the memory of the gradient slices (reallocated by backward)."""
        super().zero_grad()
        for bucket in self.buckets:
            bucket._scatter_out = None

    def _end_pass(self) -> None:
        super()._end_pass()
        for flat in self.flats:  # uses whose gradient did not come (an output not backpropagated)
            flat.uses = [0] * len(flat.params)
        self._bwd_current = None
        if self._depth == 0:
            self.release_all()

    @torch.no_grad()
    def gather_params(self) -> None:
        """After an optimizer step: the shards changed, so drop whatever is still gathered."""
        self.release_all()

    # ---- whole tensors (checkpoints) ---------------------------------------------------------------------

    @torch.no_grad()
    def full_tensors(self) -> dict[str, torch.Tensor]:
        """Local name -> the full local tensor of every parameter (collective over the ZeRO group).

        First checks, through the store, that every rank of the ZeRO group came (`reach`): a
        `state_dict()` called on some ranks only raises there, naming the others, instead of hanging."""
        reach(
            "state_dict() of a ZeRO-3 ParallelModule",
            self.zero_group,
            hint="Every rank of the ZeRO group must call it (each holds a slice of every parameter): "
            "call state_dict() on every rank and save it on the rank(s) you want.",
        )
        out: dict[str, torch.Tensor] = {}
        for flat in self.flats:
            full = torch.empty(flat.size, dtype=flat.dtype, device=flat.device)
            _all_gather_single(full, flat.shard, group=self.zero_group)
            for i, name in enumerate(flat.names):
                o = flat.offsets[i]
                out[name] = full[o : o + flat.params[i].numel()].view(flat.shapes[i])
        return out

    def __contains__(self, name: str) -> bool:
        return name in self._where

    @torch.no_grad()
    def write(self, name: str, value: torch.Tensor) -> None:
        """Load parameter `name` from its full local tensor `value` (this rank keeps its slice)."""
        flat, i = self._where[name]
        flat.write(i, value)
        self._release(flat)
        if _increment_version is not None:  # a mixed-precision optimizer refreshes its master
            _increment_version(flat.params[i])

    @torch.no_grad()
    def broadcast(self, src: int) -> None:
        """Make the data-parallel replicas equal: gather each flat buffer in every ZeRO group, broadcast
        the one of global rank `src` over the data-parallel group, keep this rank's slice."""
        self.release_all()
        for flat in self.flats:
            full = torch.empty(flat.size, dtype=flat.dtype, device=flat.device)
            _all_gather_single(full, flat.shard, group=self.zero_group)
            dist.broadcast(full, src=src, group=self.group)
            flat.shard.copy_(full[flat.lo : flat.hi])
            for p in flat.params if _increment_version is not None else []:
                _increment_version(p)

    # ---- bookkeeping ---------------------------------------------------------------------------------

    def check(self) -> None:
        """Raise if the parameters were moved or replaced since they were sharded."""
        for p, ptr in self._placeholders:
            if p.data_ptr() != ptr or any(s != 0 for s in p.stride()):
                raise RuntimeError(
                    "the parameters of a ZeRO-3 ParallelModule were moved or replaced (e.g. by module.to()) "
                    "after they were sharded; move the module first, then call build_optimizer"
                )

    def nbytes(self) -> dict[str, int]:
        """Bytes held now: full gradient buffers, reduced gradient slices, parameter shards, and the
        gathered (full) parameter buffers."""
        total = super().nbytes()
        total["params"] = sum(f.shard.numel() * f.shard.element_size() for f in self.flats)
        total["gathered"] = sum(f.size * f.shard.element_size() for f in self.flats if f.full is not None)
        return total

    def remove_hooks(self) -> None:
        super().remove_hooks()
        self.release_all()


def build_zero3(module: Any) -> Reducer | None:
    """The ZeRO-3 reducer of a ParallelModule `module` (its registered parameters, "dp" group and
    `compute_config`; see `Zero3Reducer`); None with one replica, a plain all-reduce `Reducer` when the
    ZeRO groups have one rank each (nothing to shard). Collective: creates the ZeRO groups of every
    data-parallel group, like `build_reducer`."""
    dp_group, config = module.group("dp"), module.compute_config
    if dp_group is None:
        return None
    named = [(n, i.original_name, module._tensor(n)) for n, i in module.fullmap.items() if i.is_param]
    zero_group, cross_group = zero_process_groups(
        module.rank, module.world_size, module.plan_ngpus, config.zero_ngroups
    )
    grad_dtype = torch.float32 if getattr(config, "reduce_grads_in_fp32", False) else None
    reducer: Reducer
    if zero_group is None:
        cap = config.reducer_bucket_cap_mb
        reducer = Reducer(
            [p for _, _, p in named],
            dp_group,
            bucket_cap_mb=DEFAULT_BUCKET_CAP_MB if cap is None else cap,
            async_op=config.use_async_reducer,
            grad_dtype=grad_dtype,
        )
    else:
        zero_ranks = dist.get_process_group_ranks(zero_group)
        every, _ = ParallelDims(module.plan_ngpus, module.world_size, config.zero_ngroups).all_zero_groups()
        create_twin_groups(every, "zero3-gather")
        reducer = Zero3Reducer(
            named,
            dp_group,
            zero_group,
            cross_group,
            grad_dtype=grad_dtype,
            gather_group=get_twin_group(zero_ranks, "zero3-gather"),
            prefetch=getattr(config, "zero3_prefetch_blocks", 1),
        )
    if getattr(config, "dp_grad_reduction", "mean") == "sum":
        reducer.set_grad_divisor(1)
    return reducer
