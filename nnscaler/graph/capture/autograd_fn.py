"""Custom torch.autograd.Functions keep their backward: each `Fn.apply(...)` traces as one opaque op.

torch.export inlines a Function's forward and drops its backward (a straight-through estimator
would get a zero gradient). While tracing, `Function.apply` of a user Function calls instead a
torch.library op made for that Function (one per Function and argument kinds): one node, whose fake
kernel runs the Function's forward for shapes. The node's op is then named after the Function,
`module:Qualname.apply`, and generated code calls `module.Qualname.apply(...)` itself, so the
Function's own forward and backward (ctx and all) run at run time. Without an annotation
(`nnscaler.register_op(annotation)(Fn)`) the forward is probed on small random inputs (graph/ops/
probe.py): an elementwise or row-wise Function gets the annotation of the dims along which it and its
backward commute with slicing, and runs on each device's shard; any other is kept whole on every device.

A Function the generated code cannot call (defined in `__main__` or inside a function), one that
modifies its inputs in place (ctx.mark_dirty), or one taking or returning values other than tensors
and plain literals, stops the compile with a TraceError naming it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import re
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

from nnscaler.errors import TraceError
from nnscaler.graph.ir import Graph, Node, Ref
from nnscaler.graph.ops.custom import autograd_op_name
from nnscaler.graph.ops.probe import probe_annotation
from nnscaler.graph.ops.registry import OpCall, OpRule, get_rule, op_call, register_rule

__all__ = ["opaque_autograd_functions", "name_autograd_functions"]

_NAMESPACE = "nnscaler_autograd"
_LIB: torch.library.Library | None = None
_OPS: dict[tuple, Any] = {}  # (Function class, argument kinds, output count) -> op overload
_NAMES: dict[str, str] = {}  # 'nnscaler_autograd.<name>.default' -> 'module:Qualname.apply'
_CLASSES: dict[str, type] = {}  # 'module:Qualname.apply' -> the Function
_PROBED: dict[tuple, str | None] = {}  # (op, input metas, non-tensor args) -> probed annotation
_INTERNAL = ("torch.", "nnscaler.", "functorch.")


def _why_not_callable(fn: type) -> str | None:
    """Why generated code could not import and call `fn.apply` (None when it can)."""
    module, qualname = fn.__module__, fn.__qualname__
    if module == "__main__":
        return "it is defined in __main__, which generated code cannot import"
    if "<locals>" in qualname:
        return "it is defined inside a function, where generated code cannot reach it"
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        return f"{module}.{qualname} cannot be imported ({exc})"
    if obj is not fn:
        return f"{module}.{qualname} names another object"
    return None


def _kind(value: Any) -> str | None:
    """The schema type of one argument (None: not supported)."""
    if isinstance(value, torch.Tensor):
        return "Tensor"
    if value is None:
        return "Tensor?"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, torch.SymInt)):
        return "SymInt"
    if isinstance(value, (float, torch.SymFloat)):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, (list, tuple)) and value:
        kinds = {_kind(v) for v in value}
        if kinds == {"Tensor"}:
            return "Tensor[]"
        if kinds == {"SymInt"}:
            return "SymInt[]"
        if kinds <= {"SymInt", "float"}:
            return "float[]"
    return None


def _fresh_outputs(out: Any, inputs: list[Any]) -> Any:
    """Outputs that alias an input are cloned: a custom op's results are new tensors."""
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]

    def fresh(t: torch.Tensor) -> torch.Tensor:
        return t.clone() if any(t is i or torch._C._is_alias_of(t, i) for i in tensors) else t

    return tuple(fresh(t) for t in out) if isinstance(out, tuple) else fresh(out)


def _library() -> torch.library.Library:
    global _LIB
    if _LIB is None:
        _LIB = torch.library.Library(_NAMESPACE, "FRAGMENT")
    return _LIB


def _make_op(fn: type, apply, kinds: tuple[str, ...], n_out: int | None) -> Any:
    """A custom op that runs `fn.apply` (fake kernel for shapes; eager kernel and autograd through it)."""
    base = re.sub(r"\W", "_", f"{fn.__module__}_{fn.__qualname__}")
    name = f"{base}_{len(_OPS)}"
    params = ", ".join(f"{k} a{i}" for i, k in enumerate(kinds))
    returns = "Tensor" if n_out is None else "(" + ", ".join(["Tensor"] * n_out) + ")"
    lib = _library()
    lib.define(f"{name}({params}) -> {returns}")
    qualname = f"{_NAMESPACE}::{name}"

    def run(*args: Any) -> Any:
        with torch.no_grad():
            return _fresh_outputs(apply(fn, *args), list(args))

    lib.impl(name, run, "CompositeExplicitAutograd")
    torch.library.register_fake(qualname, run, lib=lib)

    def setup_context(ctx, inputs, output):
        ctx.inputs = inputs

    def backward(ctx, *grads):
        # recompute the Function's forward with autograd on and let its own backward give the gradient
        inputs = [
            i.detach().requires_grad_(i.requires_grad) if isinstance(i, torch.Tensor) else i
            for i in ctx.inputs
        ]
        wanted = [i for i in inputs if isinstance(i, torch.Tensor) and i.requires_grad]
        with torch.enable_grad():
            out = apply(fn, *inputs)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        got = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
        by_id = {id(t): g for t, g in zip(wanted, got)}
        return tuple(by_id.get(id(i)) if isinstance(i, torch.Tensor) else None for i in inputs)

    torch.library.register_autograd(qualname, backward, setup_context=setup_context, lib=lib)
    op = getattr(getattr(torch.ops, _NAMESPACE), name).default
    _NAMES[str(op)] = autograd_op_name(fn)
    _CLASSES[autograd_op_name(fn)] = fn
    return op


def _positional(fn: type, args: tuple, kwargs: dict) -> tuple:
    if not kwargs:
        return args
    params = list(inspect.signature(fn.forward).parameters.values())
    setup_style = torch.autograd.function._is_setup_context_defined(fn.setup_context)
    sig = inspect.Signature(params if setup_style else params[1:])
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    return tuple(bound.args)


def _traced_apply(original):
    def apply(cls, *args, **kwargs):
        if cls.__module__.startswith(_INTERNAL) or cls.__module__ in ("torch", "nnscaler"):
            return original.__func__(cls, *args, **kwargs)
        name = cls.__qualname__
        why = _why_not_callable(cls)
        if why is not None:
            raise TraceError(
                f"custom autograd Function {name} cannot be kept with its backward: {why}. Generated code "
                f"calls {name}.apply itself: define {name} at the top level of an importable module"
            )
        args = _positional(cls, args, kwargs)
        kinds = tuple(_kind(a) for a in args)
        if None in kinds:
            bad = args[kinds.index(None)]
            raise TraceError(
                f"custom autograd Function {name}.apply gets an argument of type {type(bad).__name__}; only "
                "tensors, lists of tensors and plain numbers, bools, strings and None can be traced: pass "
                f"the other values another way (e.g. as attributes of {name})"
            )
        versions = [a._version for a in args if isinstance(a, torch.Tensor)]
        with disable_proxy_modes_tracing():  # for shapes only: nothing recorded
            probe = original.__func__(cls, *args)
        if versions != [a._version for a in args if isinstance(a, torch.Tensor)]:
            raise TraceError(
                f"custom autograd Function {name} modifies its input in place (ctx.mark_dirty); nnscaler cannot "
                "keep such a Function: return a new tensor instead"
            )
        outs = probe if isinstance(probe, tuple) else (probe,)
        if not outs or not all(isinstance(o, torch.Tensor) for o in outs):
            raise TraceError(
                f"custom autograd Function {name} returns {type(probe).__name__} values other than tensors; "
                "nnscaler keeps Functions that return a tensor or a tuple of tensors"
            )
        n_out = len(outs) if isinstance(probe, tuple) else None
        key = (cls, kinds, n_out)
        if key not in _OPS:
            _OPS[key] = _make_op(cls, original.__func__, kinds, n_out)
        return _OPS[key](*args)

    return apply


@contextlib.contextmanager
def opaque_autograd_functions() -> Iterator[None]:
    """Inside: calls of user autograd Functions trace as one opaque op each."""
    original = torch.autograd.Function.__dict__["apply"]
    with mock.patch.object(torch.autograd.Function, "apply", classmethod(_traced_apply(original))):
        yield


def name_autograd_functions(graph: Graph) -> Graph:
    """Name the traced Function ops after their Functions ('module:Qualname.apply')."""
    if not any(node.op in _NAMES for node in graph.nodes):
        return graph
    nodes = [dataclasses.replace(n, op=_NAMES[n.op]) if n.op in _NAMES else n for n in graph.nodes]
    graph = dataclasses.replace(graph, nodes=nodes)
    _annotate_by_probing(graph)
    return graph


def _probed(call: OpCall) -> str | None:
    """The probed annotation of one call of a Function (cached by its input metas and arguments)."""
    literal = repr(
        [a for a in call.args if not isinstance(a, (Ref, list, tuple))] + sorted(call.kwargs.items())
    )
    key = (call.node.op, tuple(call.inputs), literal)
    if key not in _PROBED:
        fn = _CLASSES[call.node.op]
        _PROBED[key] = probe_annotation(fn.apply, call.node.args, call.inputs, call.outputs)
    return _PROBED[key]


def _probed_rule(call: OpCall) -> str:
    found = _probed(call)
    if found is not None:
        return found

    # a later graph's call the probe refuses, under a rule registered for earlier ones: whole
    def whole(metas: list, tag: str) -> str:
        return ", ".join(
            " ".join(f"_{tag}{k}_{d}^" for d in range(len(m.shape))) for k, m in enumerate(metas)
        )

    return whole(call.inputs, "i") + " -> " + whole(call.outputs, "o")


def _annotate_by_probing(graph: Graph) -> None:
    """Give each Function the user did not annotate the annotation its probe finds (every call must
    pass: a Function any call of which is not elementwise or row-wise stays unannotated, kept whole)."""
    calls: dict[str, list[Node]] = {}
    for node in graph.nodes:
        if node.op in _CLASSES:
            calls.setdefault(node.op, []).append(node)
    for op, nodes in calls.items():
        rule = get_rule(op)
        if rule is not None and rule.annotate is not _probed_rule:
            continue  # the user's register_op annotation
        if all(_probed(op_call(n, graph)) is not None for n in nodes):
            register_rule(OpRule(op, _probed_rule, "user"))  # a user op, as if registered
