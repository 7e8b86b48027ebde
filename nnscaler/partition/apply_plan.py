"""apply_plan: split each node per the plan and insert communication between layouts."""

from __future__ import annotations

import math
from typing import Any

from nnscaler.errors import PartitionError
from nnscaler.graph.ir import (
    Graph,
    Layout,
    MeshLayout,
    Node,
    Partial,
    Ref,
    Replicate,
    ShapeRule,
    Shard,
    TensorMeta,
    iter_refs,
    map_refs,
    mesh_layout,
    placements_of,
    split_factors,
    storage_shard,
)
from nnscaler.graph.ops import annotate_node, get_rule, is_bias_split, layouts_for, mesh_layouts_for, op_call
from nnscaler.graph.ops.attention import CONTEXT_PARALLEL_ATTENTION
from nnscaler.graph.ops.moe import EXPERT_PARALLEL
from nnscaler.partition.context_parallel import context_parallel_statement
from nnscaler.partition.conv_bias import bias_view, conv_without_bias
from nnscaler.partition.convert import GROUP, AxisGroup, conversion_steps
from nnscaler.partition.expert_parallel import expert_parallel_statement
from nnscaler.partition.forced_layouts import check_forced_layouts
from nnscaler.partition.local_ops import group_of, localise_dim, vocab_parallel_statement
from nnscaler.partition.program import LocalTensor, Program, Statement
from nnscaler.partition.weight_grads import fold_weight_syncs
from nnscaler.policies.plan import Plan

__all__ = ["apply_plan", "local_shape"]

_MEAN_SHARE_NOTE = "mean over a split dim: each device's share of the mean (partial sums)"


def local_shape(
    shape: tuple[int, ...], layout: Layout, ways: int, mesh: tuple[int, ...] | None = None
) -> tuple[int, ...]:
    """The shape one device holds of a tensor of `shape` in `layout` over `ways` devices (as `mesh`)."""
    out = list(shape)
    for dim, parts in split_factors(layout, mesh or (ways,)).items():
        out[dim] //= parts
    return tuple(out)


def _node_layouts(bound, rule, np, mesh: tuple[int, ...]):
    """SplitLayouts (or why not) of a node's plan: 1-D over all devices, or per mesh axis."""
    if np.mesh_splits:
        return mesh_layouts_for(bound, rule, np.mesh_splits, mesh)
    return layouts_for(bound, rule, np.split, np.ways if np.split else 1, np.blocks)


def _storable(layout: Layout, mesh: tuple[int, ...]) -> Layout:
    """A layout a parameter can be stored in: cut along one dim at most (keep the outermost axis's)."""
    if not isinstance(layout, MeshLayout):
        return layout
    try:
        storage_shard(layout, 0, mesh)
        return layout
    except ValueError:
        first = next(p for p in layout.placements if isinstance(p, Shard))
        return mesh_layout([p if p == first else Replicate() for p in layout.placements])


class _Partitioner:
    def __init__(
        self, graph: Graph, plan: Plan, forced: dict[str, Layout] | None, fold: bool, keep=frozenset()
    ):
        self.graph, self.plan, self.ways = graph, plan, plan.plan_ngpus
        self.fold_weight_grads, self.keep_f = fold, keep  # see apply_plan
        self.weight_reads: dict[str, set[tuple | None]] = {}  # see weight_grads.fold_weight_syncs
        self.mesh: tuple[int, ...] = plan.mesh or (self.ways,)
        if math.prod(self.mesh) != self.ways:
            raise PartitionError(f"plan mesh {plan.mesh} does not have {self.ways} devices")
        self.forced = check_forced_layouts(graph, forced or {}, self.ways)
        self.program = Program(
            ways=self.ways, mesh=plan.mesh, forward_args=list(graph.forward_args), out_spec=graph.out_spec
        )
        self.layouts: dict[str, Layout] = {name: Replicate() for name in graph.inputs}
        self.names: set[str] = set(graph.values)
        self.cache: dict[tuple[str, Any], str] = {}

    # ---- helpers -------------------------------------------------------------------------------
    def _fresh(self, base: str) -> str:
        name, i = base, 1
        while name in self.names:
            name, i = f"{base}_{i}", i + 1
        self.names.add(name)
        return name

    def _require_divisible(self, name: str, layout: Layout) -> None:
        """A split of a size that may change between calls: the generated forward checks it divides."""
        full = self.graph.values[name].meta if name in self.graph.values else None
        if full is None or full.sym is None:
            return
        blocks = {p.dim: p.blocks for p in placements_of(layout, len(self.mesh)) if isinstance(p, Shard)}
        for dim, ways in split_factors(layout, self.mesh).items():
            code = full.sym[dim]
            if code is None:
                continue
            parts = ways * blocks[dim]
            test = f"{code} % {parts} == 0" if code.replace("_", "").isalnum() else f"({code}) % {parts} == 0"
            if any(r.code == test for r in self.program.shape_rules):
                continue
            value = self.graph.values[name]
            producer = self.graph.node(value.producer) if value.producer else None
            what = f"{name} (made at {producer.source})" if producer is not None and producer.source else name
            self.program.shape_rules.append(
                ShapeRule(test, f"the plan splits dim {dim} of {what} over {parts} parts")
            )

    def _meta(self, name: str, layout: Layout) -> None:
        self._require_divisible(name, layout)
        full = self.graph.values[name].meta if name in self.graph.values else None
        if full is not None:
            self.program.local_meta[name] = TensorMeta(
                local_shape(full.shape, layout, self.ways, self.mesh), full.dtype, full.requires_grad
            )

    def _emit(self, stmt: Statement) -> None:
        self.program.statements.append(stmt)

    def _needs_grad(self, name: str) -> bool:
        meta = self.graph.values[name].meta
        return bool(meta is not None and meta.requires_grad and meta.is_float)

    def _convert(self, name: str, dst: Layout, node: Node | None, sync: tuple = ()) -> str:
        """Local name of value `name` in layout dst; `sync` names the groups (GROUP or mesh axes) over which
        a split consumer's gradient for it is a partial sum: Megatron's f over each."""
        src = self.layouts[name]
        cur = name
        key = (name, str(dst))
        if src != dst:
            if key in self.cache:
                cur = self.cache[key]
            else:
                layout = src
                for step in conversion_steps(src, dst, len(self.mesh)):
                    out = self._fresh(f"{name}_{step.suffix}")
                    self._emit(
                        Statement(
                            "comm",
                            step.fn,
                            (Ref(cur), *step.args),
                            dict(step.kwargs),
                            [out],
                            node.name if node else None,
                            node.source if node else "",
                            node.module_path if node else "",
                            node.module_class if node else "",
                        )
                    )
                    layout = step.result
                    self.layouts[out] = layout
                    self.graph_meta_alias(out, name, layout)
                    cur = out
                self.cache[key] = cur
        if self._needs_grad(name) and self.graph.values[name].kind == "param" and name not in self.keep_f:
            self.weight_reads.setdefault(name, set()).add(tuple(sync) if cur == name else None)
        for group in sync if self._needs_grad(name) else ():
            fkey = (cur, "f", group)
            if fkey not in self.cache:
                out = self._fresh(f"{name}_tp")
                self._emit(
                    Statement(
                        "comm",
                        "copy_to_group",
                        (Ref(cur), group),
                        {},
                        [out],
                        node.name if node else None,
                        node.source if node else "",
                        node.module_path if node else "",
                        node.module_class if node else "",
                        note="f: identity forward, all-reduce of the gradient backward",
                    )
                )
                self.layouts[out] = dst
                self.graph_meta_alias(out, name, dst)
                self.cache[fkey] = out
            cur = self.cache[fkey]
        return cur

    def _sync_groups(self, np, dst: Layout, skip_axes: frozenset[int]) -> tuple:
        """Where a consumer split per `np` that reads an input in `dst` returns partial gradients: over
        every axis it splits on while holding the input whole along it (not the axes in skip_axes)."""
        if not np.mesh_splits:
            return (GROUP,) if isinstance(dst, Replicate) and not skip_axes else ()
        placements = placements_of(dst, len(self.mesh))
        axes = [
            k
            for k, (ident, _) in enumerate(np.mesh_splits)
            if ident is not None and isinstance(placements[k], Replicate) and k not in skip_axes
        ]
        if len(axes) == len(self.mesh) and len(axes) > 1:
            return (GROUP,)
        return tuple(AxisGroup(k) for k in axes)

    def graph_meta_alias(self, new: str, orig: str, layout: Layout) -> None:
        self._require_divisible(orig, layout)
        full = self.graph.values[orig].meta
        if full is not None:
            self.program.local_meta[new] = TensorMeta(
                local_shape(full.shape, layout, self.ways, self.mesh), full.dtype, full.requires_grad
            )

    # ---- parameters ----------------------------------------------------------------------------
    def _place_tensors(self) -> None:
        """Storage layout of each parameter/buffer: the forced one if given, else what its first consumer
        needs (other consumers convert from it)."""
        chosen: dict[str, Layout] = {}
        for node in self.graph.nodes:
            bound = annotate_node(node, self.graph)
            np = self.plan.node(node.name)
            refs = [r for r in _tensor_refs(node, self.graph)]
            if bound is None:
                reqs: list[Layout | None] = [Replicate()] * len(refs)
            else:
                lay = _node_layouts(bound, get_rule(node.op), np, self.mesh)
                reqs = lay.inputs if not isinstance(lay, str) else [Replicate()] * len(refs)
            for ref, req in zip(refs, reqs):
                if self.graph.values[ref.name].kind in ("param", "buffer") and ref.name not in chosen:
                    chosen[ref.name] = _storable(req or Replicate(), self.mesh)
        for v in self.graph.values.values():
            if v.kind not in ("param", "buffer"):
                continue
            layout = self.forced[v.name] if v.name in self.forced else chosen.get(v.name, Replicate())
            self.layouts[v.name] = layout
            self._meta(v.name, layout)
            self.program.tensors.append(
                LocalTensor(
                    v.name,
                    v.target or v.name,
                    v.aliases,
                    v.meta.shape,
                    v.meta.dtype,
                    layout,
                    v.kind == "param",
                    v.persistent,
                )
            )

    # ---- nodes ---------------------------------------------------------------------------------
    def run(self) -> Program:
        for name in self.graph.inputs:
            self._meta(name, Replicate())
        self.program.input_leaves = list(self.graph.input_leaves)
        self.program.in_spec = self.graph.in_spec
        self.program.input_constants = dict(self.graph.input_constants)
        self.program.untraced_args = dict(self.graph.untraced_args)
        self.program.recompute = tuple(self.plan.recompute)
        self.program.input_meta = {n: self.graph.values[n].meta for n in self.graph.inputs}
        self.program.size_names = dict(self.graph.size_names)
        self.program.shape_rules = list(self.graph.shape_rules)
        self.program.static_shapes = self.graph.static_shapes
        self.program.constant_names = sorted(self.graph.constants)
        self._place_tensors()
        for node in self.graph.nodes:
            self._node(node)
        out_refs = {}
        for ref in (r for r in iter_refs(self.graph.outputs)):
            out_refs[ref.name] = self._convert(ref.name, Replicate(), None)
        self.program.outputs = map_refs(self.graph.outputs, lambda r: Ref(out_refs[r.name]))
        if self.fold_weight_grads:
            fold_weight_syncs(self.program, self.weight_reads, self.layouts)
        self.program.layouts = dict(self.layouts)
        self.program.module_classes = dict(self.graph.module_classes)
        return self.program

    def _node(self, node: Node) -> None:
        np = self.plan.node(node.name)
        bound = annotate_node(node, self.graph)
        rule = get_rule(node.op)
        split = np.is_split and bound is not None
        refs = _tensor_refs(node, self.graph)
        reqs, outs = self._io_layouts(node, np, bound, rule, len(refs)) if split else self._whole(node, refs)
        split_axes = self._split_axes(np) if split else ()
        bias_axes = frozenset(k for k, (ident, ways) in split_axes if is_bias_split(bound, rule, ident, ways))
        args, kwargs = self._local_inputs(node, np, rule, refs, reqs, bias_axes, split)
        for out, layout in zip(node.outputs, outs):
            self.layouts[out] = layout
            self._meta(out, layout)
        common = dict(
            node=node.name,
            source=node.source,
            module_path=node.module_path,
            module_class=node.module_class,
            note=np.note,
            no_grad=node.no_grad,
        )
        if not split:
            outputs = list(node.outputs)
            self._emit(
                Statement(
                    "op", node.op, tuple(args), kwargs, outputs, **common, tuple_output=node.tuple_output
                )
            )
            return
        specials = {
            k: rule.specials[ident] for k, (ident, _) in split_axes if rule and ident in rule.specials
        }
        if node.op == "aten.dropout.default":
            # a sharded activation: each shard needs its own mask (see nnscaler.runtime.rng)
            p, train = args[1], args[2]
            call_args = (args[0], p, train, self._shard_group(node, split_axes))
            self._emit(
                Statement("special", "rng.sharded_dropout", call_args, {}, list(node.outputs), **common)
            )
        elif any(sp.emit == CONTEXT_PARALLEL_ATTENTION for sp in specials.values()):
            self._emit(
                context_parallel_statement(
                    node, self.plan, specials, split_axes, args, kwargs, common, self.mesh
                )
            )
        elif any(sp.emit == EXPERT_PARALLEL for sp in specials.values()):
            self._emit(expert_parallel_statement(node, specials, args, kwargs, common, self.mesh))
        elif specials:
            self._vocab_parallel(node, rule, bound, specials, split_axes, args, kwargs, common)
        elif bias_axes:
            self._bias_split(node, rule, bias_axes, split_axes, outs[0], args, kwargs, common)
        else:
            self._split_op(node, rule, bound, split_axes, args, kwargs, common)

    def _whole(self, node: Node, refs: list[Ref]) -> tuple[list[Layout], list[Layout]]:
        """An op that runs whole: every input read replicated, every output replicated."""
        return [Replicate()] * len(refs), [Replicate()] * len(node.outputs)

    def _io_layouts(self, node: Node, np, bound, rule, nrefs: int) -> tuple[list[Layout], list[Layout]]:
        """The layouts a split node reads its tensor inputs in, and those of its outputs."""
        lay = _node_layouts(bound, rule, np, self.mesh)
        if isinstance(lay, str):
            raise PartitionError(f"node {node.name} ({node.op}) cannot be split as {np.describe()}: {lay}")
        return [r or Replicate() for r in lay.inputs], [o or Replicate() for o in lay.outputs]

    def _local_inputs(self, node: Node, np, rule, refs, reqs, bias_axes, split: bool) -> tuple[Any, Any]:
        """The node's args and kwargs with every tensor read in the layout it needs (a converted copy
        where it is held in another)."""
        local = []  # per tensor argument: a value read twice (x @ x) may be needed in two layouts
        for i, (ref, req) in enumerate(zip(refs, reqs)):
            # the bias of a row-parallel op is added after the reduction, by every rank alike: no f
            skip = bias_axes if bias_axes and i == rule.bias_input else frozenset()
            sync = self._sync_groups(np, req, skip) if split else ()
            local.append(self._convert(ref.name, req, node, sync))
        tensors = iter(local)

        def localise(r: Ref) -> Ref:
            return Ref(next(tensors)) if self.graph.values[r.name].meta is not None else r

        return map_refs(node.args, localise), map_refs(node.kwargs, localise)

    def _mean_share(self, node: Node, rule, reduced: int) -> str | None:
        """A temporary to write the op into when it takes a mean over dims split `reduced` ways: each
        device computes its share of the mean (partial sums) by dividing it (`_divide_share`); else None."""
        mean = rule.mean_scale(op_call(node, self.graph)) if callable(rule.mean_scale) else rule.mean_scale
        if not (mean and reduced > 1):
            return None
        tmp = self._fresh(f"{node.outputs[0]}_local")
        self.program.local_meta[tmp] = self.program.local_meta[node.outputs[0]]
        return tmp

    def _divide_share(self, node: Node, tmp: str, reduced: int, common: dict) -> None:
        common = {**common, "note": _MEAN_SHARE_NOTE}
        self._emit(Statement("scale", "div", (Ref(tmp), reduced), {}, list(node.outputs), **common))

    def _vocab_parallel(self, node: Node, rule, bound, specials, split_axes, args, kwargs, common) -> None:
        """Local code for a split vocabulary; other axes may split the batch: a mean over it is then
        each device's share (as in `_split_op`)."""
        others = [(k, s) for k, s in split_axes if k not in specials]
        reduced = math.prod(ways for _, (ident, ways) in others if bound.anno.flag_of(ident) == "+")
        tmp = self._mean_share(node, rule, reduced)
        outputs = [tmp] if tmp else list(node.outputs)
        self._emit(
            vocab_parallel_statement(
                node, specials, split_axes, bound, args, kwargs, common, outputs, self.mesh
            )
        )
        if tmp:
            self._divide_share(node, tmp, reduced, common)

    def _split_op(self, node: Node, rule, bound, split_axes, args, kwargs, common) -> None:
        """A split op whose local code is the op on the local shards, its shape arguments made local."""
        multi: dict[str, Any] = dict(tuple_output=node.tuple_output)
        args = self._localise_args(node, args)
        if rule is not None and rule.local_args is not None:
            args, kwargs = rule.local_args(tuple(args), dict(kwargs), dict(s for _, s in split_axes))
        if node.op == "aten.scaled_dot_product_attention.default":
            dropout_p = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
            if dropout_p and self._shard_group(node, split_axes) is not GROUP:
                raise PartitionError(
                    f"node {node.name} ({node.op}, {node.source}): attention with dropout split on some mesh "
                    "axes only; split it on every axis or on one (split/ways)"
                )
            multi["shard_rng"] = bool(dropout_p)  # each shard of heads needs its own masks
        reduced = math.prod(ways for _, (ident, ways) in split_axes if bound.anno.flag_of(ident) == "+")
        tmp = self._mean_share(node, rule, reduced)
        if tmp is None:
            self._emit(Statement("op", node.op, tuple(args), kwargs, list(node.outputs), **common, **multi))
            return
        self._emit(Statement("op", node.op, tuple(args), kwargs, [tmp], **common))
        self._divide_share(node, tmp, reduced, common)

    def _split_axes(self, np) -> tuple[tuple[int, tuple[str, int]], ...]:
        """(axis, (identifier, devices)) of each split: one entry spanning all devices for a 1-D split
        (axis -1: the whole group), else one per mesh axis the node is split on."""
        if not np.mesh_splits:
            return ((-1, (np.split, np.ways)),)
        return tuple((k, (ident, self.mesh[k])) for k, (ident, _) in enumerate(np.mesh_splits) if ident)

    def _shard_group(self, node: Node, split_axes) -> object:
        """The group whose rank tells this device's shard apart (random ops draw a stream per shard)."""
        return group_of([k for k, _ in split_axes], self.mesh)

    def _localise_args(self, node: Node, args: tuple) -> tuple:
        """Divide the shape arguments of split dims by the split (sizes may be run-time expressions)."""
        if not node.outputs or node.outputs[0] not in self.layouts:
            return args
        factors = split_factors(self.layouts[node.outputs[0]], self.mesh)
        for d, ways in sorted(factors.items()):
            args = localise_dim(self.graph, node, args, d, ways)
        return args

    def _bias_split(self, node: Node, rule, bias_axes, split_axes, out_layout, args, kwargs, common) -> None:
        refs = list(iter_refs((args, kwargs)))
        bias = refs[rule.bias_input]
        out = node.outputs[0]
        partial = self._fresh(f"{out}_partial")
        if node.op == "aten.addmm.default":
            self._emit(Statement("op", "aten.mm.default", (refs[1], refs[2]), {}, [partial], **common))
        elif node.op in ("aten.baddbmm.default", "aten.addbmm.default"):  # beta=0: the input is ignored
            alpha = node.args[4] if len(node.args) > 4 else node.kwargs.get("alpha", 1)
            kw = {"beta": 0, "alpha": alpha}
            self._emit(Statement("op", node.op, (refs[0], refs[1], refs[2]), kw, [partial], **common))
        elif rule.family == "conv":
            local = conv_without_bias(node, rule, args, kwargs, bias, dict(s for _, s in split_axes))
            self._emit(Statement("op", node.op, *local, [partial], **common))
        else:
            self._emit(Statement("op", node.op, (refs[0], refs[1]), {}, [partial], **common))
        placements = list(placements_of(out_layout, len(self.mesh)))
        for k in bias_axes:
            for j in range(len(self.mesh)) if k == -1 else (k,):
                placements[j] = Partial()
        self.layouts[partial] = mesh_layout(placements)
        self.graph_meta_alias(partial, out, out_layout)
        reduced = self._fresh(f"{out}_reduced")
        group = group_of(bias_axes, self.mesh)
        self._emit(Statement("comm", "reduce_from_group", (Ref(partial), group), {}, [reduced], **common))
        self.layouts[reduced] = out_layout
        self.graph_meta_alias(reduced, out, out_layout)
        if rule.family == "conv":  # (o,) -> (o, 1, ..): broadcast over the spatial dims
            view = self._fresh(f"{bias.name}_view")
            spatial = len(self.graph.values[node.input_names()[1]].meta.shape) - 2
            stmt, meta = bias_view(bias, self.program.local_meta[bias.name], spatial, view, common)
            self._emit(stmt)
            self.program.local_meta[view], bias = meta, Ref(view)
        common = {**common, "note": "bias added once, after the reduction"}
        self._emit(Statement("bias", "add", (Ref(reduced), bias), {}, [out], **common))


def _tensor_refs(node: Node, graph: Graph) -> list[Ref]:
    return [r for r in iter_refs((node.args, node.kwargs)) if graph.values[r.name].meta is not None]


def apply_plan(
    graph: Graph,
    plan: Plan,
    forced_layouts: dict[str, Layout] | None = None,
    *,
    fold_weight_grads: bool = False,
    keep: frozenset[str] = frozenset(),
) -> Program:
    """The SPMD program one plan replica runs; rank-specific constants stay symbolic (RankScaled).

    forced_layouts: parameter / buffer name -> the layout to store it in, whatever its consumers need
    (they get converted copies); pipeline stages sharing a tied weight use it to store it alike.
    fold_weight_grads: a weight held whole along plan axes where its readers are split (on data dims)
    gets no `copy_to_group`; `Program.grad_groups` names those axes and the gradient reducer sums its
    gradient over them with the data-parallel replicas (bucketed, overlapped with backward); not the
    weights named in `keep`."""
    return _Partitioner(graph, plan, forced_layouts, fold_weight_grads, keep).run()
