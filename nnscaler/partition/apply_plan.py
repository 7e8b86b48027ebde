"""apply_plan: split each node per the plan and insert communication between layouts."""

from __future__ import annotations

from typing import Any

from nnscaler.errors import PartitionError
from nnscaler.graph.ir import (
    Graph,
    Layout,
    Node,
    Partial,
    Ref,
    Replicate,
    ShapeRule,
    Shard,
    TensorMeta,
    map_refs,
    sym_floordiv,
)
from nnscaler.graph.ops import annotate_node, get_rule, is_bias_split, layouts_for
from nnscaler.partition.convert import GROUP, conversion_steps
from nnscaler.partition.program import LocalTensor, Program, RankScaled, Statement
from nnscaler.policies import Plan

__all__ = ["apply_plan", "local_shape"]

_SHAPE_ARG_OPS = {
    "aten.view.default",
    "aten.reshape.default",
    "aten._unsafe_view.default",
    "aten.expand.default",
}
_CE_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def local_shape(shape: tuple[int, ...], layout: Layout, ways: int) -> tuple[int, ...]:
    if isinstance(layout, Shard) and ways > 1:
        out = list(shape)
        out[layout.dim] //= ways
        return tuple(out)
    return tuple(shape)


class _Partitioner:
    def __init__(self, graph: Graph, plan: Plan, forced_layouts: dict[str, Layout] | None = None):
        self.graph, self.plan, self.ways = graph, plan, plan.plan_ngpus
        self.forced = _check_forced(graph, forced_layouts or {}, self.ways)
        self.program = Program(ways=self.ways, forward_args=list(graph.forward_args), out_spec=graph.out_spec)
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
        if full is None or full.sym is None or not isinstance(layout, Shard) or self.ways == 1:
            return
        code = full.sym[layout.dim]
        if code is None:
            return
        parts = self.ways * layout.blocks
        test = f"{code} % {parts} == 0" if code.replace("_", "").isalnum() else f"({code}) % {parts} == 0"
        if any(r.code == test for r in self.program.shape_rules):
            return
        value = self.graph.values[name]
        producer = self.graph.node(value.producer) if value.producer else None
        what = f"{name} (made at {producer.source})" if producer is not None and producer.source else name
        self.program.shape_rules.append(
            ShapeRule(test, f"the plan splits dim {layout.dim} of {what} over {parts} parts")
        )

    def _meta(self, name: str, layout: Layout) -> None:
        self._require_divisible(name, layout)
        full = self.graph.values[name].meta if name in self.graph.values else None
        if full is not None:
            self.program.local_meta[name] = TensorMeta(
                local_shape(full.shape, layout, self.ways), full.dtype, full.requires_grad
            )

    def _emit(self, stmt: Statement) -> None:
        self.program.statements.append(stmt)

    def _needs_grad(self, name: str) -> bool:
        meta = self.graph.values[name].meta
        return bool(meta is not None and meta.requires_grad and meta.is_float)

    def _convert(self, name: str, dst: Layout, node: Node | None, sync_grad: bool) -> str:
        """Local name of value `name` in layout dst; `sync_grad` adds Megatron's f for split consumers."""
        src = self.layouts[name]
        cur = name
        key = (name, str(dst))
        if src != dst:
            if key in self.cache:
                cur = self.cache[key]
            else:
                layout = src
                for step in conversion_steps(src, dst):
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
        if sync_grad and isinstance(dst, Replicate) and self._needs_grad(name):
            fkey = (cur, "f")
            if fkey not in self.cache:
                out = self._fresh(f"{name}_tp")
                self._emit(
                    Statement(
                        "comm",
                        "copy_to_group",
                        (Ref(cur), GROUP),
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

    def graph_meta_alias(self, new: str, orig: str, layout: Layout) -> None:
        self._require_divisible(orig, layout)
        full = self.graph.values[orig].meta
        if full is not None:
            self.program.local_meta[new] = TensorMeta(
                local_shape(full.shape, layout, self.ways), full.dtype, full.requires_grad
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
                lay = layouts_for(bound, get_rule(node.op), np.split, np.ways if np.split else 1, np.blocks)
                reqs = lay.inputs if not isinstance(lay, str) else [Replicate()] * len(refs)
            for ref, req in zip(refs, reqs):
                if self.graph.values[ref.name].kind in ("param", "buffer") and ref.name not in chosen:
                    chosen[ref.name] = req or Replicate()
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
        for ref in (r for r in _iter(self.graph.outputs)):
            out_refs[ref.name] = self._convert(ref.name, Replicate(), None, sync_grad=False)
        self.program.outputs = map_refs(self.graph.outputs, lambda r: Ref(out_refs[r.name]))
        self.program.layouts = dict(self.layouts)
        self.program.module_classes = dict(self.graph.module_classes)
        return self.program

    def _node(self, node: Node) -> None:
        np = self.plan.node(node.name)
        bound = annotate_node(node, self.graph)
        rule = get_rule(node.op)
        split = np.split is not None and np.ways > 1 and bound is not None
        refs = _tensor_refs(node, self.graph)
        if split:
            lay = layouts_for(bound, rule, np.split, np.ways, np.blocks)
            if isinstance(lay, str):
                raise PartitionError(f"node {node.name} ({node.op}) cannot be split on {np.split!r}: {lay}")
            reqs, outs = [r or Replicate() for r in lay.inputs], [o or Replicate() for o in lay.outputs]
        else:
            reqs, outs = [Replicate()] * len(refs), [Replicate()] * len(node.outputs)
        bias_split = split and is_bias_split(bound, rule, np.split, np.ways)
        local = {}
        for i, (ref, req) in enumerate(zip(refs, reqs)):
            if ref.name not in local:
                # the bias of a row-parallel op is added after the reduction, by every rank alike: no f
                sync = split and not (bias_split and i == rule.bias_input)
                local[ref.name] = self._convert(ref.name, req, node, sync_grad=sync)
        args = map_refs(node.args, lambda r: Ref(local.get(r.name, r.name)))
        kwargs = map_refs(node.kwargs, lambda r: Ref(local.get(r.name, r.name)))
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
        multi = dict(tuple_output=node.tuple_output)
        if not split:
            self._emit(Statement("op", node.op, tuple(args), kwargs, list(node.outputs), **common, **multi))
            return
        special = rule.specials.get(np.split) if rule else None
        if node.op == "aten.dropout.default":
            # a sharded activation: each shard needs its own mask (see nnscaler.runtime.rng)
            p, train = args[1], args[2]
            self._emit(
                Statement(
                    "special",
                    "rng.sharded_dropout",
                    (args[0], p, train, GROUP),
                    {},
                    list(node.outputs),
                    **common,
                )
            )
        elif special is not None:
            self._special(node, special.emit, bound, np, args, kwargs, common)
        elif bias_split:
            self._bias_split(node, rule.bias_input, args, kwargs, common)
        else:
            args = self._localise_args(node, args)
            if node.op == "aten.scaled_dot_product_attention.default":
                dropout_p = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
                multi["shard_rng"] = bool(dropout_p)  # each shard of heads needs its own masks
            mean = rule.mean_scale(_call(node, self.graph)) if callable(rule.mean_scale) else rule.mean_scale
            if mean and bound.anno.flag_of(np.split) == "+":
                tmp = self._fresh(f"{node.outputs[0]}_local")
                self._emit(Statement("op", node.op, tuple(args), kwargs, [tmp], **common))
                self.program.local_meta[tmp] = self.program.local_meta[node.outputs[0]]
                common["note"] = "mean over a split dim: each device's share of the mean (partial sums)"
                self._emit(Statement("scale", "div", (Ref(tmp), np.ways), {}, list(node.outputs), **common))
            else:
                self._emit(
                    Statement("op", node.op, tuple(args), kwargs, list(node.outputs), **common, **multi)
                )

    def _localise_args(self, node: Node, args: tuple) -> tuple:
        """Divide the shape arguments of split dims by the split (sizes may be run-time expressions)."""
        if not node.outputs or node.outputs[0] not in self.layouts:
            return args
        layout = self.layouts[node.outputs[0]]
        if not isinstance(layout, Shard):
            return args
        d = layout.dim
        if node.op in _SHAPE_ARG_OPS:
            sizes = list(args[1])
            sizes[d] = _local_size(sizes[d], self.ways)
            return (args[0], sizes, *args[2:])
        if node.op == "aten.unflatten.int":
            dim, sizes = args[1], list(args[2])
            dim %= len(self.graph.values[node.input_names()[0]].meta.shape)
            if dim <= d < dim + len(sizes):
                sizes[d - dim] = _local_size(sizes[d - dim], self.ways)
            return (args[0], dim, sizes, *args[3:])
        if node.op == "aten.split.Tensor":
            dim = (args[2] if len(args) > 2 else 0) % len(self.graph.values[node.outputs[0]].meta.shape)
            if dim == d:
                return (args[0], _local_size(args[1], self.ways), *args[2:])
        return args

    def _special(self, node: Node, emit: str, bound, np, args, kwargs, common) -> None:
        refs = [a for a in _iter((args, kwargs))]
        if emit == "vocab_parallel_embedding":
            vocab = bound.sizes["v"]
            padding = args[2] if len(args) > 2 else kwargs.get("padding_idx", -1)
            extra = {"padding_idx": padding} if padding is not None and padding >= 0 else {}
            call_args = (refs[1], refs[0], RankScaled(vocab // np.ways))
        else:
            ignore = args[4] if len(args) > 4 else kwargs.get("ignore_index", -100)
            reduction = _CE_REDUCTIONS[args[3] if len(args) > 3 else kwargs.get("reduction", 1)]
            extra = {"ignore_index": ignore, "reduction": reduction}
            if emit == "vocab_parallel_cross_entropy":
                call_args = (refs[0], refs[1], RankScaled(bound.sizes["c"] // np.ways), GROUP)
            else:
                call_args = (refs[0], refs[1], GROUP)
        self._emit(Statement("special", emit, call_args, extra, list(node.outputs), **common))

    def _bias_split(self, node: Node, bias_input: int, args, kwargs, common) -> None:
        refs = list(_iter((args, kwargs)))
        bias = refs[bias_input]
        out = node.outputs[0]
        partial = self._fresh(f"{out}_partial")
        if node.op == "aten.addmm.default":
            self._emit(Statement("op", "aten.mm.default", (refs[1], refs[2]), {}, [partial], **common))
        else:
            self._emit(Statement("op", node.op, (refs[0], refs[1]), {}, [partial], **common))
        self.layouts[partial] = Partial()
        self.graph_meta_alias(partial, out, Replicate())
        reduced = self._fresh(f"{out}_reduced")
        self._emit(Statement("comm", "reduce_from_group", (Ref(partial), GROUP), {}, [reduced], **common))
        self.graph_meta_alias(reduced, out, Replicate())
        common = {**common, "note": "bias added once, after the reduction"}
        self._emit(Statement("bias", "add", (Ref(reduced), bias), {}, [out], **common))


def _local_size(size, ways: int):
    """This rank's share of a size argument; -1 (inferred) stays -1."""
    return size if isinstance(size, int) and size == -1 else sym_floordiv(size, ways)


def _iter(obj):
    from nnscaler.graph.ir import iter_refs

    return iter_refs(obj)


def _tensor_refs(node: Node, graph: Graph) -> list[Ref]:
    return [r for r in _iter((node.args, node.kwargs)) if graph.values[r.name].meta is not None]


def _call(node: Node, graph: Graph):
    from nnscaler.graph.ops import op_call

    return op_call(node, graph)


def _check_forced(graph: Graph, forced: dict[str, Layout], ways: int) -> dict[str, Layout]:
    """Forced storage layouts must name parameters/buffers of the graph and split them evenly."""
    for name, layout in forced.items():
        value = graph.values.get(name)
        if value is None or value.kind not in ("param", "buffer"):
            raise PartitionError(
                f"forced_layouts names {name!r}, which is not a parameter or buffer of the graph"
            )
        if isinstance(layout, Partial):
            raise PartitionError(
                f"forced_layouts[{name!r}] is Partial: a stored tensor must be Replicate or Shard"
            )
        if isinstance(layout, Shard) and not -len(value.meta.shape) <= layout.dim < len(value.meta.shape):
            raise PartitionError(
                f"forced_layouts[{name!r}] = {layout}: {name} has {len(value.meta.shape)} dims "
                f"(shape {tuple(value.meta.shape)}); choose one of them or Replicate()"
            )
        if isinstance(layout, Shard) and ways > 1:
            size = value.meta.shape[layout.dim]
            if size % (ways * layout.blocks):
                raise PartitionError(
                    f"forced_layouts[{name!r}] = {layout}: dim {layout.dim} of size {size} does not split into "
                    f"{ways} x {layout.blocks} equal pieces; choose another dim or Replicate()"
                )
    return dict(forced)


def apply_plan(graph: Graph, plan: Plan, forced_layouts: dict[str, Layout] | None = None) -> Program:
    """The SPMD program one plan replica runs; rank-specific constants stay symbolic (RankScaled).

    forced_layouts: parameter / buffer name -> the layout to store it in, whatever its consumers need
    (they get converted copies); pipeline stages sharing a tied weight use it to store it alike."""
    return _Partitioner(graph, plan, forced_layouts).run()
