"""Turn a torch.export program into our Graph, keeping source lines, module paths and state-dict names."""

from __future__ import annotations

import dataclasses
import keyword
import operator
import os
import re
from typing import Any

import torch
import torch.fx
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from nnscaler.errors import TraceError
from nnscaler.graph.capture.symbolic import SizeNames
from nnscaler.graph.ir import Graph, GraphBuilder, Node, Ref, ShapeRule, TensorMeta, Value

__all__ = ["convert_exported"]

_RESERVED_NAMES = frozenset({"self", "tp", "dp", "mb", "torch", "F", "comm", "rng", "ckpt", "math", "pytree"})
"""Names the generated code uses for itself (modules, groups): values are never given them."""

_DROPPED_OPS = {
    "aten._assert_tensor_metadata.default",
    "aten._assert_scalar.default",
    "aten.sym_constrain_range_for_size.default",
}


_SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)
_SIZE_OPS = {
    "aten.sym_size.int",
    "aten.sym_numel.default",
    "aten.sym_stride.int",
    "aten.sym_storage_offset.default",
}


def _hint(size: Any) -> int:
    """The traced value of a (possibly symbolic) size, without adding a guard."""
    if isinstance(size, torch.SymInt):
        node = size.node
        return int(node.hint if node.hint is not None else node.shape_env.size_hint(node.expr))
    return int(size)


def _source_of(fx_node: torch.fx.Node) -> str:
    """'file.py:52  code' for the innermost user frame of the node's stack trace."""
    trace = fx_node.meta.get("stack_trace") or ""
    matches = list(re.finditer(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)', trace))
    if not matches:
        return ""
    user = [m for m in matches if "/torch/" not in m.group(1)]
    m = (user or matches)[-1]
    return f"{os.path.basename(m.group(1))}:{m.group(2)}  {m.group(3).strip()}"


def _module_of(fx_node: torch.fx.Node) -> tuple[str, str]:
    stack = fx_node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    path, cls = list(stack.values())[-1]
    cls_name = cls if isinstance(cls, str) else getattr(cls, "__qualname__", str(cls))
    return str(path), cls_name.rsplit(".", 1)[-1]


class _Converter:
    def __init__(self, ep: torch.export.ExportedProgram, module: torch.nn.Module, forward_args: list[str]):
        self.ep = ep
        self.module = module
        self.graph = GraphBuilder(
            module_class=f"{type(module).__module__}.{type(module).__qualname__}", forward_args=forward_args
        )
        self.env: dict[str, Any] = {}  # fx node name -> Ref / list of Refs / constant
        self.names: set[str] = set()
        self.tied = self._tied_names()
        self.by_target: dict[str, str] = {}
        self.sizes = SizeNames()

    def _meta_of(self, val: Any, what: str = "a tensor") -> TensorMeta | None:
        """Shape (traced values), dtype and requires_grad; `sym` for dims that may change."""
        if isinstance(val, torch.Tensor):
            return TensorMeta(
                tuple(_hint(s) for s in val.shape),
                str(val.dtype).removeprefix("torch."),
                bool(val.requires_grad),
                self.sizes.dim_codes(val, what),
            )
        return None

    def _tied_names(self) -> dict[str, list[str]]:
        groups: dict[int, list[str]] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            groups.setdefault(id(p), []).append(name)
        for name, b in self.module.named_buffers(remove_duplicate=False):
            groups.setdefault(id(b), []).append(name)
        return {n: names for names in groups.values() for n in names}

    def _fresh(self, base: str) -> str:
        name = re.sub(r"\W", "_", base)
        if name[:1].isdigit() or not name:
            name = "v_" + name
        if keyword.iskeyword(name) or name in _RESERVED_NAMES:  # `class`, `self`: not a usable local name
            name += "_"
        cand, i = name, 1
        while cand in self.names:
            cand, i = f"{name}_{i}", i + 1
        self.names.add(cand)
        return cand

    def convert(self) -> GraphBuilder:
        specs = {spec.arg.name: spec for spec in self.ep.graph_signature.input_specs}
        non_persistent = (
            set(self.ep.graph_signature.non_persistent_buffers)
            if hasattr(self.ep.graph_signature, "non_persistent_buffers")
            else set()
        )
        for fx_node in self.ep.graph.nodes:
            if fx_node.op == "placeholder":
                self._placeholder(fx_node, specs[fx_node.name], non_persistent)
            elif fx_node.op == "call_function":
                self._call(fx_node, self.ep.graph_module, no_grad=False)
            elif fx_node.op == "output":
                self._output(fx_node)
            elif fx_node.op == "get_attr":
                self.env[fx_node.name] = fx_node.target  # submodule name for higher-order ops
        self.graph.size_names = dict(self.sizes.names)
        self.graph.shape_rules = self.sizes.range_rules(self.ep.range_constraints) + self.graph.shape_rules
        return self.graph

    def _placeholder(self, fx_node, spec, non_persistent) -> None:
        val = fx_node.meta.get("val")
        if spec.kind == InputKind.USER_INPUT and isinstance(val, torch.Tensor):
            self.sizes.bind_input(fx_node.name, val)
        meta = self._meta_of(val, f"input {fx_node.name}")
        if spec.kind == InputKind.PARAMETER:
            kind, target = "param", spec.target
        elif spec.kind == InputKind.BUFFER:
            kind, target = "buffer", spec.target
        elif spec.kind == InputKind.USER_INPUT:
            kind, target = "input", fx_node.name
        elif spec.kind == InputKind.CONSTANT_TENSOR:  # torch.tensor([...]) in forward: a fixed buffer
            kind, target = "buffer", spec.target
            self.graph.constants[target] = self.ep.constants[spec.target].detach().cpu().clone()
        else:
            raise TraceError(
                f"forward uses {fx_node.name} ({spec.kind.name}), an input kind nnscaler does not support; "
                "register the object as a tensor buffer (self.register_buffer) instead"
            )
        if kind == "input" and meta is None:
            value = fx_node.meta.get("val")
            self.env[fx_node.name] = value
            if value is None or isinstance(value, (bool, int, float, str)):
                self.graph.input_constants[str(len(self.graph.input_leaves))] = value
            self.graph.input_leaves.append(None)
            return
        if kind != "input":
            canonical = self.tied.get(target, [target])[0]
            if canonical in self.by_target:  # a tied weight lifted twice: one value for both names
                self.env[fx_node.name] = Ref(self.by_target[canonical])
                return
            target = canonical
        base = target if kind != "input" else fx_node.name
        name = self._fresh(base)
        if kind != "input":
            self.by_target[target] = name
        aliases = tuple(n for n in self.tied.get(target, [target]) if n != target) if kind != "input" else ()
        if kind == "param":
            meta = meta and dataclasses.replace(meta, requires_grad=meta.requires_grad and meta.is_float)
        persistent = target not in self.graph.constants and not (
            kind == "buffer"
            and (
                not spec.persistent
                if hasattr(spec, "persistent") and spec.persistent is not None
                else target in non_persistent
            )
        )
        self.graph.values[name] = Value(name, meta, kind, None, target, aliases, persistent)
        if kind == "input":
            self.graph.inputs.append(name)
            self.graph.input_leaves.append(name)
        self.env[fx_node.name] = Ref(name)

    def _arg(self, a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return self.env[a.name]
        if isinstance(a, (list, tuple)):
            items = [self._arg(x) for x in a]
            return items if isinstance(a, list) else tuple(items)
        if isinstance(a, dict):
            return {k: self._arg(v) for k, v in a.items()}
        return a

    def _call(self, fx_node: torch.fx.Node, gm: torch.fx.GraphModule, no_grad: bool) -> None:
        target = fx_node.target
        if target is operator.getitem:
            container = self.env[fx_node.args[0].name]
            self.env[fx_node.name] = container[fx_node.args[1]]
            return
        name = getattr(target, "__name__", str(target))
        if name == "wrap_with_set_grad_enabled":
            self._inline(fx_node, gm, enabled=fx_node.args[0])
            return
        if isinstance(target, torch._ops.HigherOrderOperator):
            raise TraceError(f"higher-order op {name} at {_source_of(fx_node)} is not supported yet")
        op = str(target)
        val = fx_node.meta.get("val")
        if (
            isinstance(val, _SYM_TYPES)
            or op in _SIZE_OPS
            or (isinstance(val, (int, float, bool)) and not isinstance(target, torch._ops.OpOverload))
        ):
            # a size computed from input shapes (x.shape[0], B * T, ...): an expression, not an op
            self.env[fx_node.name] = self.sizes.value(val, f"{fx_node.name} at {_source_of(fx_node)}")
            return
        if op == "aten._assert_scalar.default":
            self._assert_rule(fx_node)
            return
        if op in _DROPPED_OPS:
            return
        args, kwargs = self._arg(fx_node.args), self._arg(fx_node.kwargs)
        self._check_not_writing_activation(target, args, fx_node)
        source = _source_of(fx_node)
        mpath, mcls = _module_of(fx_node)
        for path, cls in (fx_node.meta.get("nn_module_stack") or {}).values():
            name = cls if isinstance(cls, str) else getattr(cls, "__qualname__", str(cls))
            self.graph.module_classes.setdefault(str(path), name.rsplit(".", 1)[-1])
        node_name = self._fresh(fx_node.name)
        outputs: list[str] = []
        if isinstance(val, (list, tuple)):
            refs = []
            for i, item in enumerate(val):
                vname = self._fresh(f"{node_name}_{i}")
                self.graph.values[vname] = Value(
                    vname, self._meta_of(item, node_name), "activation", node_name
                )
                outputs.append(vname)
                refs.append(Ref(vname))
            self.env[fx_node.name] = refs
        elif val is None and not isinstance(val, torch.Tensor):
            self.env[fx_node.name] = None
        else:
            self.graph.values[node_name] = Value(
                node_name, self._meta_of(val, node_name), "activation", node_name
            )
            outputs.append(node_name)
            self.env[fx_node.name] = Ref(node_name)
        self.graph.nodes.append(
            Node(
                node_name,
                op,
                tuple(args),
                dict(kwargs),
                outputs,
                source,
                mpath,
                mcls,
                no_grad,
                isinstance(val, (list, tuple)),
            )
        )

    def _assert_rule(self, fx_node: torch.fx.Node) -> None:
        """export's run-time assertion on sizes (e.g. a branch taken on `x.shape[0] % 2`) -> a ShapeRule."""
        cond = self._arg(fx_node.args[0])
        if cond is True:
            return
        if cond is False:
            raise TraceError(
                f"the model asserts a condition on sizes that the trace breaks at {_source_of(fx_node)}"
            )
        message = fx_node.args[1] if len(fx_node.args) > 1 else ""
        where = _source_of(fx_node) or "the model"
        why = f"a condition on sizes found when tracing, at {where}"
        if message:
            why += f" ({str(message).splitlines()[0][:120]})"
        self.graph.shape_rules.append(ShapeRule(cond.code, why))

    def _check_not_writing_activation(self, target: Any, args: Any, fx_node: torch.fx.Node) -> None:
        """Writes into activations were made functional by torch (capture/functionalize.py); an
        in-place op reaching here may only update a parameter, buffer or input."""
        if not isinstance(target, torch._ops.OpOverload):
            return
        for i, arg in enumerate(target._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write or i >= len(args):
                continue
            ref = args[i]
            if isinstance(ref, Ref) and self.graph.values[ref.name].kind == "activation":
                raise TraceError(
                    f"{target} at {_source_of(fx_node) or 'forward'} writes into a computed tensor, which "
                    "capture should have made functional: please report this with the model's code"
                )

    def _inline(self, fx_node: torch.fx.Node, gm: torch.fx.GraphModule, enabled: bool) -> None:
        sub = getattr(gm, fx_node.args[1].target)
        operands = [self.env[a.name] if isinstance(a, torch.fx.Node) else a for a in fx_node.args[2:]]
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        for ph, operand in zip(placeholders, operands):
            self.env[ph.name] = operand
        for n in sub.graph.nodes:
            if n.op == "call_function":
                self._call(n, sub, no_grad=not enabled)
            elif n.op == "output":
                out = self._arg(n.args[0])
                self.env[fx_node.name] = list(out) if isinstance(out, (list, tuple)) else [out]

    def _output(self, fx_node: torch.fx.Node) -> None:
        specs = self.ep.graph_signature.output_specs
        flat = list(fx_node.args[0])
        user = []
        for spec, item in zip(specs, flat):
            if spec.kind == OutputKind.USER_OUTPUT:
                user.append(self._arg(item) if isinstance(item, torch.fx.Node) else item)
            else:
                raise TraceError(
                    f"forward mutates {spec.target} ({spec.kind.name}); in-place updates of buffers or inputs "
                    "are not supported yet"
                )
        self.graph.outputs = user
        self.graph.out_spec = pytree.treespec_dumps(self.ep.call_spec.out_spec)
        self.graph.in_spec = pytree.treespec_dumps(self.ep.call_spec.in_spec)


def convert_exported(
    ep: torch.export.ExportedProgram, module: torch.nn.Module, forward_args: list[str]
) -> Graph:
    """Build a Graph from an exported program; values keep state-dict names, nodes keep source lines."""
    graph = _Converter(ep, module, forward_args).convert()
    _propagate_requires_grad(graph)
    return graph.build()


def _propagate_requires_grad(graph: GraphBuilder) -> None:
    """A value needs grad when it is a float output of a grad-enabled node with a grad-needing input."""
    for node in graph.nodes:
        needs = not node.no_grad and any(
            graph.values[n].meta is not None and graph.values[n].meta.requires_grad
            for n in node.input_names()
        )
        for out in node.outputs:
            v = graph.values[out]
            if v.meta is not None:
                meta = dataclasses.replace(v.meta, requires_grad=bool(needs and v.meta.is_float))
                graph.values[out] = dataclasses.replace(v, meta=meta)
