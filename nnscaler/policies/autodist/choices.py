"""The candidate partitions of every node, each with its layouts, compute time, internal
communication, and the cost and memory of the parameters it reads."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from nnscaler.graph.ir import Graph, Layout, Node, Replicate, Shard, iter_refs, placements_of, split_factors
from nnscaler.graph.ops import (
    annotate_node,
    get_rule,
    is_bias_split,
    layouts_for,
    mesh_layouts_for,
    split_candidates,
)
from nnscaler.graph.ops.moe import MOE_EXPERTS_OP
from nnscaler.policies.autodist.comm import all_reduce
from nnscaler.policies.autodist.constraints import PartitionConstraints, unsatisfiable_error
from nnscaler.policies.autodist.cost import CostContext, compute_time, is_free_op, local_bytes, node_flops
from nnscaler.policies.autodist.expert_gemm import ExpertShapes, experts_time
from nnscaler.policies.autodist.memo import graph_memo
from nnscaler.policies.autodist.memory import MemoryModel
from nnscaler.policies.autodist.saved_tensors import Kept, kept_bytes_plan
from nnscaler.policies.blocks import blocks_hint
from nnscaler.policies.plan import REPLICATE, NodePlan

__all__ = ["Choice", "NodeChoices", "node_choices", "tensor_refs"]

_MATMUL_PREFIX = (
    "aten.linear",
    "aten.mm",
    "aten.bmm",
    "aten.matmul",
    "aten.addmm",
    "aten.baddbmm",
    "aten.addbmm",
    "aten.einsum",
    "aten.mv",
    "aten.tensordot",
    "aten.inner",
    "aten.linalg_multi_dot",
)
_MATMUL_LIKE = ("attention", "conv", "moe_experts")


@dataclass(frozen=True)
class Choice:
    """One way to run a node: its NodePlan and what it costs."""

    plan: NodePlan
    inputs: tuple[Layout | None, ...]
    """Layout required of each tensor input (None: a '?' input, taken as it comes)."""
    outputs: tuple[Layout | None, ...]
    compute: float
    """Seconds of compute per step on one device."""
    comm: float
    """Seconds of communication inside the op (specials, bias after a reduction) and of the partial gradients
    of replicated parameters it reads while split (summed inside the plan)."""
    memory: float
    """Bytes per device: parameters it owns (with gradients and optimizer state) and saved activations."""
    sync: float = 0.0
    """Seconds per step to synchronise the gradients of the parameters it owns across data-parallel
    replicas (once per step, not per micro-batch)."""
    param_bytes: float = 0.0
    """Bytes per device of the parameters it owns (weights only)."""
    activation_bytes: float = 0.0
    """Bytes per device of its outputs kept for backward."""

    @property
    def time(self) -> float:
        return self.compute + self.comm


@dataclass
class NodeChoices:
    node: Node
    refs: list[str]
    """Tensor inputs (value names), in annotation order."""
    choices: list[Choice] = field(default_factory=list)


def tensor_refs(graph: Graph, node: Node) -> list[str]:
    return [r.name for r in iter_refs((node.args, node.kwargs)) if graph.values[r.name].meta]


def _plans(graph: Graph, node: Node, bound, ways: int, mesh: tuple[int, ...] = ()) -> list[NodePlan]:
    plans = [REPLICATE]
    if ways <= 1 or bound is None:
        return plans
    hint = blocks_hint(graph, node.outputs[0]) if node.outputs else 1
    for ident in split_candidates(bound, ways):
        plans.append(NodePlan(ident, ways))
        if hint > 1 and _keeps_blocks(bound, node, ident, ways, hint):
            plans.append(NodePlan(ident, ways, hint))
    if len(mesh) in (2, 3) and min(mesh) > 1:
        plans += _mesh_plans(node, bound, mesh, hint)
    return plans


def _keeps_blocks(bound, node: Node, ident: str, ways: int, hint: int) -> bool:
    lay = layouts_for(bound, get_rule(node.op), ident, ways, hint)
    outs = [] if isinstance(lay, str) else lay.outputs
    return any(isinstance(o, Shard) and o.blocks == hint for o in outs)


def _mesh_plans(node: Node, bound, mesh: tuple[int, ...], hint: int) -> list[NodePlan]:
    """Mesh splits: a batch-like identifier (dim 0 or 1 of the first tensor input, carried to the
    output, not reduced, not in a weight) over axis 0 and a different splittable identifier over each
    other axis (3 axes: e.g. a linear's n over axis 1 and k over axis 2)."""
    first = next((t for t in bound.anno.inputs if t.dims), None)
    if first is None or not bound.anno.outputs or not any(t.dims for t in bound.anno.outputs):
        return []
    out_ids = {i for t in bound.anno.outputs if t.dims for d in t.dims for i in d.ids}
    outer = []
    for d in first.dims[:2]:
        ident = d.ids[0]
        if (
            ident in out_ids
            and bound.anno.flag_of(ident) != "+"
            and ident in split_candidates(bound, mesh[0])
        ):
            outer.append(ident)
    rule = get_rule(node.op)
    plans = []
    for a in outer:
        for inner in _inner_splits(node, bound, mesh, hint, (a,)):
            cand = NodePlan(mesh_splits=((a, 1), *inner))
            if not isinstance(mesh_layouts_for(bound, rule, cand.mesh_splits, mesh), str):
                plans.append(cand)
    return plans


def _inner_splits(node: Node, bound, mesh: tuple[int, ...], hint: int, taken: tuple[str, ...]):
    """(identifier, blocks) per mesh axis after the first, each identifier new (blocks only in 2-D)."""
    axis = len(taken)
    if axis == len(mesh):
        yield ()
        return
    for b in split_candidates(bound, mesh[axis]):
        if b in taken:
            continue
        for blocks in (1, hint) if hint > 1 and len(mesh) == 2 else (1,):
            if blocks > 1 and not _keeps_blocks(bound, node, b, mesh[axis], blocks):
                continue
            for rest in _inner_splits(node, bound, mesh, hint, (*taken, b)):
                yield ((b, blocks), *rest)


def _structure(graph: Graph, node: Node):
    """(tensor input names, the node's bound annotation or None, its op rule); once per graph."""
    memo = graph_memo(graph)
    key = ("node", node.name)
    if key not in memo:
        memo[key] = (tuple(tensor_refs(graph, node)), annotate_node(node, graph), get_rule(node.op))
    return memo[key]


def _with_layouts(node: Node, refs, bound, rule, plan: NodePlan, mesh: tuple[int, ...] = ()):
    """(plan, input layouts, output layouts); layouts None where the split is not valid here."""
    if bound is None:
        return plan, tuple(Replicate() for _ in refs), tuple(Replicate() for _ in node.outputs)
    if plan.mesh_splits:
        lay = mesh_layouts_for(bound, rule, plan.mesh_splits, mesh) if mesh else "no mesh"
    else:
        lay = layouts_for(bound, rule, plan.split, plan.ways if plan.split else 1, plan.blocks)
    if isinstance(lay, str):
        return plan, None, None
    return plan, tuple(lay.inputs), tuple(lay.outputs)


def _options(graph: Graph, node: Node, refs, bound, rule, ways: int, mesh: tuple[int, ...] = ()):
    """Every plan of `node` over `ways` devices (and 2-D over `mesh`) with its layouts (see
    _with_layouts); once per graph."""
    memo = graph_memo(graph)
    key = ("plans", node.name, ways, mesh)
    if key not in memo:
        memo[key] = [
            _with_layouts(node, refs, bound, rule, p, mesh) for p in _plans(graph, node, bound, ways, mesh)
        ]
    return memo[key]


def node_choices(
    graph: Graph,
    node: Node,
    ctx: CostContext,
    memory: MemoryModel,
    owned_params: set[str],
    constraints: PartitionConstraints | None = None,
    saved: bool = True,
    only: NodePlan | None = None,
    recompute: tuple[str, ...] = (),
) -> NodeChoices:
    """Every allowed partition of `node` over ctx.ways devices with its costs.

    owned_params: parameters whose memory and data-parallel gradient sync this node accounts for
    (each parameter is owned by its first reader). saved: False counts no activations at all.
    recompute: the recomputed module paths (saved_tensors.py: what the node's outputs keep for
    backward, each saved value once, at its storage; inside a recomputed module only its inputs).
    only: cost just this plan (a fixed plan being evaluated).
    """
    refs, bound, rule = _structure(graph, node)
    out = NodeChoices(node, list(refs))
    kept = kept_bytes_plan(graph, recompute).get(node.name) if ctx.training else None
    metas_in = [graph.values[r].meta for r in refs]
    metas_out = [graph.values[o].meta for o in node.outputs]
    in_bytes = [ctx.value_bytes(graph, r) for r in refs]
    out_bytes = [ctx.value_bytes(graph, o) for o in node.outputs]
    acts = [
        r
        for r in [*refs, *node.outputs]
        if graph.values[r].meta and graph.values[r].kind not in ("param", "buffer")
    ]
    # FLOPs follow the batch: the largest scaling of an activation (weights never scale)
    scale = max((ctx.value_scale(graph, r) for r in acts), key=lambda v: abs(v - 1.0), default=1.0)
    flops = node_flops(node, graph) * scale
    dtype = next((m.dtype for m in metas_out if m is not None), "float32")
    free = is_free_op(node, graph)
    matmul = node.op.startswith(_MATMUL_PREFIX) or any(k in node.op for k in _MATMUL_LIKE)
    pctx, shard = (ctx.experts_context(), ctx.ep_degree) if node.op == MOE_EXPERTS_OP else (ctx, 1)
    read_bytes = [b / shard if graph.values[r].kind == "param" else b for r, b in zip(refs, in_bytes)]
    mesh = ctx.mesh
    if only is not None:
        candidates = [_with_layouts(node, refs, bound, rule, only, mesh)]
    else:
        candidates = _options(graph, node, refs, bound, rule, ctx.ways, mesh)
    for plan, ins, outs in candidates:
        if ins is None or (constraints is not None and not constraints.allows(graph, node, bound, plan)):
            continue
        ways = ctx.plan_ways(plan)
        moved = sum(local_bytes(b, lay_, ways, mesh) for b, lay_ in zip(read_bytes, ins)) + sum(
            local_bytes(b, lay_, ways, mesh) for b, lay_ in zip(out_bytes, outs)
        )
        compute = 0.0 if free else compute_time(flops / ways, moved, ctx, dtype, matmul)
        compute = _experts_compute(graph, node, refs, ins, ways, ctx, shard, dtype, compute)
        compute = _measured_compute(graph, node, refs, ins, ways, ctx, dtype, free, scale, compute)
        comm, param_local, sync = _param_costs(
            graph,
            refs,
            in_bytes,
            ins,
            plan=plan,
            ctx=ctx,
            memory=memory,
            owned_params=owned_params,
            pctx=pctx,
            shard=shard,
            comm=_internal_comm(bound, rule, plan, in_bytes, out_bytes, ctx),
            bias_slot=rule.bias_input if _bias_axes(bound, rule, plan, ctx) else None,
        )
        act = (
            _kept_bytes(graph, refs, node, kept, in_bytes, out_bytes, ins, outs, ways, ctx) if saved else 0.0
        )
        mem = memory.param_state_bytes(param_local, pctx) + act * memory.activation_factor
        out.choices.append(Choice(plan, ins, outs, compute, comm, mem, sync, param_local, act))
    if not out.choices and constraints:  # the rules forbid every partition the shapes allow
        valid = [_label(plan) for plan, ins, _ in candidates if ins is not None and plan.is_split]
        raise unsatisfiable_error(graph, node, ctx.ways, constraints, valid, bound)
    if not out.choices:  # `only` is not valid here: replicate (build_problem reports the fixed plan)
        compute = compute_time(flops, sum(in_bytes) + sum(out_bytes), ctx, dtype, matmul)
        out.choices.append(_replicated(node, metas_in, compute))
    return out


def _measured_compute(graph: Graph, node: Node, refs, ins, ways, ctx, dtype, free, scale, compute) -> float:
    """The profiled time of this choice where the database has it (`compute` otherwise)."""
    if ctx.measured and free and ctx.training:  # no kernel, but dispatch and autograd bookkeeping
        return ctx.free_op
    if ctx.measured and not free and ctx.training and scale == 1.0:
        key = op_key(node.op, _local_shapes(graph, refs, ins, ways, ctx.mesh), dtype)
        return ctx.measured.get(key, compute)
    return compute


def _kept_bytes(graph: Graph, refs, node: Node, kept: Kept | None, in_bytes, out_bytes, ins, outs, ways, ctx):
    """Bytes per device this node's outputs keep for backward in this choice's layouts (Kept)."""
    if kept is None:
        return 0.0
    mesh = ctx.mesh
    total = sum(local_bytes(out_bytes[i], outs[i], ways, mesh) for i in kept.outputs)
    for side, i, elems, size in kept.extras:
        names, lays, whole = (refs, ins, in_bytes) if side == "in" else (node.outputs, outs, out_bytes)
        if i >= len(names):
            continue
        meta = graph.values[names[i]].meta
        nbytes = elems * (size or ctx.elem_bytes(meta.dtype)) * ctx.value_scale(graph, names[i])
        share = local_bytes(whole[i], lays[i], ways, mesh) / whole[i] if whole[i] else 1.0
        total += nbytes * share
    return total


def _experts_compute(
    graph: Graph, node: Node, refs, ins, ways: int, ctx: CostContext, shard: int, dtype: str, default: float
) -> float:
    """An experts op's compute on one rank (autodist/expert_gemm.py: grouped GEMMs, a roofline each with
    a small-GEMM efficiency; `default` for any other op) from its local shapes: hidden
    [t, h], top_k_index [t, k], gate_up [e, 2i, h], down [e, h, i]; the experts 1/`shard` (ep) per
    rank, receiving as many rows as the rank's own tokens send; without ep the op's backward reruns its
    forward. `default` where the shapes are not concrete ints (symbolic)."""
    if node.op != MOE_EXPERTS_OP:
        return default
    shapes = _local_shapes(graph, refs, ins, ways, ctx.mesh)
    if len(shapes) < 5 or not all(isinstance(d, int) for s in shapes for d in s):
        return default
    (t, h), (_, k), down = shapes[0], shapes[1], shapes[4]
    rows = t * k * ctx.value_scale(graph, refs[0])
    s = ExpertShapes(rows, max(down[0] // shard, 1), h, down[2])
    dt = ctx.compute_dtype or dtype
    return experts_time(s, ctx.cluster.device, dt, ctx.elem_bytes(dtype), ctx.training, refwd=shard == 1)


def _replicated(node: Node, metas_in, compute: float) -> Choice:
    """The fallback choice of a node whose fixed plan is not valid: replicated, nothing else counted."""
    ins = tuple(Replicate() if m is not None else None for m in metas_in)
    return Choice(REPLICATE, ins, tuple(Replicate() for _ in node.outputs), compute, 0.0, 0.0)


def _label(plan: NodePlan) -> str:
    """A split in words for messages: 'n', or 'b x n' for a 2-D split."""
    if plan.mesh_splits:
        return " x ".join(ident or "-" for ident, _ in plan.mesh_splits)
    return str(plan.split)


def _param_costs(
    graph: Graph,
    refs,
    in_bytes: list[float],
    ins,
    *,
    plan: NodePlan,
    ctx: CostContext,
    memory: MemoryModel,
    owned_params: set[str],
    comm: float,
    bias_slot: int | None,
    pctx: CostContext | None = None,
    shard: int = 1,
) -> tuple[float, float, float]:
    """What the parameters and buffers a choice reads add: (`comm` plus the all-reduces of replicated
    parameters' partial gradients, bytes per device of the owned ones, seconds of their gradient sync).
    bias_slot: the input added once after the op's all-reduce (no partial gradient). pctx, shard: the
    owned parameters' replica group and the further split of their bytes (an experts op under ep)."""
    param_local = 0.0
    sync = 0.0
    ways = ctx.plan_ways(plan)
    for slot, (ref, b, lay_) in enumerate(zip(refs, in_bytes, ins)):
        value = graph.values[ref]
        if value.kind not in ("param", "buffer"):
            continue
        if value.kind == "param" and plan.is_split and ctx.training and slot != bias_slot:
            comm += _partial_grad_time(b, lay_, plan, ctx)  # each device holds a partial gradient
        if ref in owned_params:
            local = local_bytes(b, lay_, ways, ctx.mesh) / shard
            param_local += local
            if value.kind == "param":
                sync += memory.grad_sync_time(local, pctx or ctx)
    return comm, param_local, sync


def _local_shapes(
    graph: Graph, refs: list[str], layouts, ways: int, mesh: tuple[int, ...] = ()
) -> list[tuple[int, ...]]:
    out = []
    for ref, lay in zip(refs, layouts):
        shape = list(graph.values[ref].meta.shape)
        if lay is not None and ways > 1:
            for dim, parts in split_factors(lay, mesh or (ways,)).items():
                shape[dim] //= parts
        out.append(tuple(shape))
    return out


def _bias_axes(bound, rule, plan: NodePlan, ctx: CostContext) -> list[int]:
    """Mesh axes (-1: all devices, a 1-D split) over which the op reduces before adding its bias."""
    if bound is None:
        return []
    if plan.mesh_splits:
        return [
            k
            for k, ((ident, _), size) in enumerate(zip(plan.mesh_splits, ctx.mesh))
            if ident is not None and is_bias_split(bound, rule, ident, size)
        ]
    return [-1] if is_bias_split(bound, rule, plan.split, ctx.plan_ways(plan)) else []


def _partial_grad_time(nbytes: float, layout, plan: NodePlan, ctx: CostContext) -> float:
    """All-reduce of a replicated parameter's partial gradients over the axes the op splits while
    holding the parameter whole along them (the whole group for a 1-D split)."""
    if not plan.mesh_splits:
        return all_reduce(nbytes, ctx.ways, ctx.tp_link) if isinstance(layout, Replicate) else 0.0
    placements = placements_of(layout, len(ctx.mesh))
    axes = [
        k
        for k, (ident, _) in enumerate(plan.mesh_splits)
        if ident is not None and isinstance(placements[k], Replicate)
    ]
    held = local_bytes(nbytes, layout, ctx.ways, ctx.mesh)
    if len(axes) == len(ctx.mesh):
        return all_reduce(held, ctx.ways, ctx.tp_link)
    return sum(all_reduce(held, ctx.mesh[k], ctx.axis_link(k)) for k in axes)


def op_key(op: str, shapes: list[tuple[int, ...]], dtype: str) -> str:
    """The key of an op at local input shapes in a measured database (profiler.ProfileDB)."""
    return f"{op}|{';'.join('x'.join(map(str, s)) for s in shapes)}|{dtype.replace('torch.', '')}"


def _internal_comm(bound, rule, plan: NodePlan, in_bytes, out_bytes, ctx: CostContext) -> float:
    """Communication a split does inside the op: the all-reduce after a reduction with a bias, and the
    collectives of special local code (vocab-parallel embedding and cross entropy). A 2-D split pays
    each axis's over that axis's devices, on the bytes the other axis leaves each of them."""
    if not plan.is_split or bound is None or ctx.ways <= 1:
        return 0.0
    if not plan.mesh_splits:
        return _split_comm(bound, rule, plan.split, in_bytes, out_bytes, ctx.ways, ctx.tp_link, ctx.training)
    total = 0.0
    for k, ((ident, _), size) in enumerate(zip(plan.mesh_splits, ctx.mesh)):
        if ident is None:
            continue
        others = math.prod(s for j, s in enumerate(ctx.mesh) if j != k and plan.mesh_splits[j][0] is not None)
        ins, outs = [b / others for b in in_bytes], [b / others for b in out_bytes]
        total += _split_comm(bound, rule, ident, ins, outs, size, ctx.axis_link(k), ctx.training)
    return total


def _split_comm(bound, rule, ident: str, in_bytes, out_bytes, p: int, link, training: bool) -> float:
    """_internal_comm of a split on `ident` over `p` devices joined by `link`."""
    special = rule.specials.get(ident) if rule is not None else None
    if special is not None and special.output == "replicate":
        size = bound.sizes.get(ident, 1) or 1
        rows = max(in_bytes[0] / size if in_bytes else 0.0, sum(out_bytes))
        return all_reduce(rows, p, link) * (2.0 if training else 1.0)
    if rule is not None and rule.bias_input is not None and bound.anno.flag_of(ident) == "+":
        if rule.bias_input < len(bound.anno.inputs):
            return all_reduce(sum(out_bytes), p, link)
    return 0.0
