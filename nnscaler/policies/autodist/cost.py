"""The analytic cost model: FLOPs and bytes per op from its annotation and traced shapes, compute time
on a DeviceSpec, and the time of turning one layout of a tensor into another (forward + backward).

Times are seconds for one training step of one micro-batch (forward + backward) unless
`CostContext.training` is False (forward only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from nnscaler.graph.ir import (
    Graph,
    Layout,
    MeshLayout,
    Partial,
    Replicate,
    Shard,
    mesh_layout,
    placements_of,
    redistribute_moves,
    split_factors,
)
from nnscaler.policies.autodist.cluster import ClusterSpec
from nnscaler.policies.autodist.comm import all_gather, all_reduce, all_to_all, reduce_scatter
from nnscaler.policies.op_cost import DTYPE_BYTES, dtype_bytes, is_free_op, node_flops  # device-independent

__all__ = [
    "CostContext",
    "DTYPE_BYTES",
    "dtype_bytes",
    "node_flops",
    "compute_time",
    "reshard_time",
    "local_bytes",
    "traced_batch_size",
    "is_free_op",
]


@dataclass(frozen=True)
class CostContext:
    """What the cost of a plan depends on besides the graph."""

    cluster: ClusterSpec
    ways: int = 1
    """Devices an op is split over (the tensor-parallel group of one stage)."""
    dp_size: int = 1
    """Data-parallel replicas of the plan (runtime_ngpus // plan_ngpus, or the searched dp degree)."""
    dp_stride: int = 1
    """Distance in ranks between data-parallel peers (the plan size)."""
    training: bool = True
    """Forward and backward (False: forward only)."""
    compute_dtype: str | None = None
    """Dtype the math runs in (None: the traced dtype; 'bfloat16' plans an fp32-traced model for bf16)."""
    batch_scale: float = 1.0
    """Multiplies the size of activations that carry the batch (micro-batch size relative to the traced one)."""
    measured: dict[str, float] | None = None
    """Measured forward + backward seconds by op key (profiler.ProfileDB.entries); used where present."""
    free_op: float = 0.0
    """Measured forward + backward seconds of an op that moves no data (profiler.ProfileDB.free_op_s)."""
    traced_batch: int = 0
    """Batch size of the trace: an activation whose dim 0 is a multiple of it carries the batch (0: all do)."""
    mesh: tuple[int, ...] = ()
    """The stage's devices as a mesh of 2 or 3 axes (row-major) when mesh splits are offered; () for
    1-D only."""
    mesh_options: tuple[tuple[int, ...], ...] = ()
    """Meshes the SPMD search tries, each solved on its own, the cheapest taken (spmd.solve_spmd);
    () or one: `mesh` alone."""
    ep_degree: int = 1
    """The expert-parallel degree this stage is the per-rank problem of (autodist/expert_parallel.py):
    the experts ops' weights are 1/ep_degree per rank, reduced over their own replica group."""

    def experts_context(self) -> CostContext:
        """The context of the experts ops' weights under ep: dp_size / ep replicas, ep x dp_stride apart."""
        ep = self.ep_degree
        return replace(self, dp_size=max(self.dp_size // ep, 1), dp_stride=self.dp_stride * ep, ep_degree=1)

    def axis_link(self, axis: int):
        """The link of one mesh axis's group (axis 0's members are the inner axes' size apart)."""
        return self.cluster.link(self.mesh[axis], math.prod(self.mesh[axis + 1 :]))

    def plan_ways(self, plan) -> int:
        """Devices a NodePlan divides the work over (1 when replicated)."""
        if plan.mesh_splits:
            return math.prod(
                size for (ident, _), size in zip(plan.mesh_splits, self.mesh) if ident is not None
            )
        return plan.ways if plan.split else 1

    def value_scale(self, graph: Graph, name: str) -> float:
        """batch_scale for an activation that carries the batch, else 1 (parameters, positions, masks)."""
        if self.batch_scale == 1.0:
            return 1.0
        value = graph.values[name]
        if value.kind in ("param", "buffer") or value.meta is None:
            return 1.0
        shape = value.meta.shape
        if self.traced_batch <= 1:
            return self.batch_scale
        return (
            self.batch_scale
            if shape and shape[0] >= self.traced_batch and shape[0] % self.traced_batch == 0
            else 1.0
        )

    def value_bytes(self, graph: Graph, name: str) -> float:
        """Bytes of a whole tensor, scaled to the micro-batch."""
        meta = graph.values[name].meta
        return meta.numel * self.elem_bytes(meta.dtype) * self.value_scale(graph, name) if meta else 0.0

    @property
    def tp_link(self):
        return self.cluster.link(self.ways)

    @property
    def dp_link(self):
        return self.cluster.link(self.dp_size, self.dp_stride)

    def elem_bytes(self, dtype: str) -> int:
        if self.compute_dtype is not None and dtype.replace("torch.", "").startswith(("float", "bfloat")):
            return dtype_bytes(self.compute_dtype)
        return dtype_bytes(dtype)


def compute_time(flops: float, nbytes: float, ctx: CostContext, dtype: str, matmul: bool) -> float:
    """Roofline time of one op: max(FLOPs / sustained peak, bytes / sustained bandwidth) + launch; a
    matmul sustains the device's fraction for its FLOPs per call (gemm_efficiency.py)."""
    dev = ctx.cluster.device
    dt = ctx.compute_dtype or dtype
    peak = dev.tflops(dt) * 1e12 * (dev.matmul_fraction(flops) if matmul else 0.5)
    bw = dev.mem_bw_gbs * 1e9 * dev.mem_efficiency
    fwd = max(flops / peak, nbytes / bw) + dev.kernel_overhead_us * 1e-6
    return fwd * (3.0 if ctx.training else 1.0)


def local_bytes(nbytes: float, layout: Layout | None, ways: int, mesh: tuple[int, ...] = ()) -> float:
    """Bytes one device holds of a tensor of `nbytes` in `layout` (a MeshLayout: over `mesh`)."""
    if isinstance(layout, MeshLayout):
        return nbytes / math.prod(split_factors(layout, mesh).values())
    return nbytes / ways if isinstance(layout, Shard) else nbytes


def reshard_time(
    src: Layout | None,
    dst: Layout | None,
    nbytes: float,
    ctx: CostContext,
    consumer_split: bool,
    needs_grad: bool,
    shared_grad_reduce: bool = False,
) -> float:
    """Time to give a consumer layout `dst` of a tensor produced in `src` (forward + its backward).

    consumer_split: the consumer runs split (each device computes a different part), so the
    gradient it returns for a replicated input is a partial sum that must be all-reduced.
    shared_grad_reduce: leave out that all-reduce (the caller charges it once for all consumers
    of the value: their partial gradients are summed locally first).
    Returns inf where no conversion exists (nothing converts to Partial).
    """
    if src is None or dst is None or ctx.ways <= 1:
        return 0.0
    bwd = ctx.training and needs_grad
    if isinstance(src, MeshLayout) or isinstance(dst, MeshLayout):
        return _mesh_reshard_time(
            src, dst, nbytes, ctx, consumer_split and bwd and not shared_grad_reduce, bwd
        )
    return _placement_time(src, dst, nbytes, ctx.ways, ctx.tp_link, bwd, consumer_split, shared_grad_reduce)


def _mesh_reshard_time(
    src: Layout, dst: Layout, nbytes: float, ctx: CostContext, f_grad: bool, bwd: bool
) -> float:
    """reshard_time on a 2-D mesh: each per-axis move (redistribute_moves) as a 1-D conversion over that
    axis's devices, on the bytes one such group holds; a split consumer's partial gradients of an input it
    holds whole along an axis are all-reduced over that axis (Megatron's f per axis)."""
    links = tuple(ctx.axis_link(k) for k in range(len(ctx.mesh)))
    return _mesh_reshard_cached(src, dst, nbytes, ctx.mesh, ctx.ways, links, ctx.tp_link, f_grad, bwd)


@lru_cache(maxsize=1 << 16)  # the search costs the same few layout pairs on the same tensors many times
def _mesh_reshard_cached(
    src, dst, nbytes: float, mesh, ways: int, links, tp_link, f_grad: bool, bwd: bool
) -> float:
    naxes = len(mesh)
    try:
        moves = redistribute_moves(src, dst, naxes)
    except ValueError:
        return float("inf")
    total, cur = 0.0, src
    for m in moves:
        placements = list(placements_of(cur, naxes))
        placements[m.axis] = Replicate()
        group_bytes = local_bytes(nbytes, mesh_layout(placements), ways, mesh)
        total += _placement_time(m.src, m.dst, group_bytes, mesh[m.axis], links[m.axis], bwd, False, True)
        cur = m.after
    if f_grad:
        held = local_bytes(nbytes, dst, ways, mesh)
        whole = [k for k, p in enumerate(placements_of(dst, naxes)) if isinstance(p, Replicate)]
        if len(whole) == naxes:
            total += all_reduce(held, ways, tp_link)
        else:
            total += sum(all_reduce(held, mesh[k], links[k]) for k in whole)
    return total


def _placement_time(
    src: Layout,
    dst: Layout,
    nbytes: float,
    p: int,
    link,
    bwd: bool,
    consumer_split: bool,
    shared_grad_reduce: bool,
) -> float:
    """reshard_time between 1-D placements over a group of p devices joined by `link`."""
    if isinstance(dst, Partial):
        return 0.0 if isinstance(src, Partial) else float("inf")
    if isinstance(src, Replicate):
        if isinstance(dst, Replicate):
            return all_reduce(nbytes, p, link) if (bwd and consumer_split and not shared_grad_reduce) else 0.0
        return all_gather(nbytes, p, link) if bwd else 0.0  # forward: a local slice
    if isinstance(src, Partial):
        if isinstance(dst, Replicate):
            return all_reduce(nbytes, p, link)
        return reduce_scatter(nbytes, p, link) + (all_gather(nbytes, p, link) if bwd else 0.0)
    # src is a Shard
    if isinstance(dst, Replicate):
        back = reduce_scatter(nbytes, p, link) if (bwd and consumer_split) else 0.0
        return all_gather(nbytes, p, link) + back
    if src == dst:
        return 0.0
    return all_to_all(nbytes / p, p, link) * (2.0 if bwd else 1.0)


def traced_batch_size(graph: Graph) -> int:
    """Dim 0 of the first tensor forward input (the batch the model was traced with), 0 if none."""
    for name in graph.inputs:
        v = graph.values[name]
        if v.kind == "input" and v.meta is not None and v.meta.shape:
            return v.meta.shape[0]
    return 0
