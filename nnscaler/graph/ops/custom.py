"""register_op: let a user op (a torch.library custom op or a plain function) trace as one node,
split per its annotation, and be called by name in the generated code."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from nnscaler.graph.ir import iter_refs
from nnscaler.graph.ops.annotation import OpAnno, parse_annotation
from nnscaler.graph.ops.registry import OpRule, register_rule

__all__ = ["register_op", "op_module", "autograd_op_name", "is_autograd_op"]

_NAMESPACE = "nnscaler_user"
_MODULES: dict[str, str] = {}  # op name ('ns.name.overload') -> module to import in generated code
_EMITTERS: dict[str, Callable] = {}  # op name -> register_op's emit_fn


def op_emitter(op: str) -> Callable | None:
    """The `emit_fn` registered for `op` (it writes the op's call in generated code), or None."""
    return _EMITTERS.get(op)


def autograd_op_name(fn: type) -> str:
    """The op of a custom autograd Function's nodes, 'module:Qualname.apply': generated code imports
    the module and calls `module.Qualname.apply(...)` (see nnscaler.graph.capture.autograd_fn)."""
    return f"{fn.__module__}:{fn.__qualname__}.apply"


def is_autograd_op(op: str) -> bool:
    """Whether the op is a custom autograd Function's apply (named by autograd_op_name)."""
    return op.endswith(".apply") and ":" in op


def op_module(op: str) -> str | None:
    """The Python module that registers a non-aten op (imported by generated code), if known."""
    if is_autograd_op(op):
        return op.split(":", 1)[0]
    if op in _MODULES:
        return _MODULES[op]
    from torch._library.custom_ops import OPDEFS

    qualname = "::".join(op.rsplit(".", 1)[0].split(".", 1))
    opdef = OPDEFS.get(qualname)
    return getattr(getattr(opdef, "_init_fn", None), "__module__", None) if opdef else None


def _op_name(op: Any) -> str | None:
    """'ns.name.overload' for a custom op object, None for a plain function."""
    if isinstance(op, type) and issubclass(op, torch.autograd.Function):
        return autograd_op_name(op)
    if isinstance(op, torch._ops.OpOverload):
        return str(op)
    if isinstance(op, torch._ops.OpOverloadPacket):
        return f"{op._qualified_op_name.replace('::', '.')}.default"
    qualname = getattr(op, "_qualname", None)  # torch.library.custom_op's CustomOpDef
    if isinstance(qualname, str) and "::" in qualname:
        return f"{qualname.replace('::', '.')}.default"
    return None


def _with_return_type(fn: Callable, n_outputs: int) -> tuple[Callable, str | None]:
    """`fn` and its schema (None: torch infers it from the hints) for a function with a return hint;
    for one without (nnScaler 0.8 accepts those), the return is taken from the annotation's outputs
    (one: a Tensor, k: a tuple of k Tensors) and `fn` is wrapped to check that at trace time."""
    if inspect.signature(fn).return_annotation is not inspect.Signature.empty:
        return fn, None
    sig = inspect.signature(fn, eval_str=True)  # string hints (`from __future__ import annotations`)
    ret: Any = torch.Tensor if n_outputs == 1 else tuple[(torch.Tensor,) * n_outputs]
    want = "a Tensor" if n_outputs == 1 else f"a tuple of {n_outputs} Tensors"

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        ok = (
            isinstance(out, torch.Tensor)
            if n_outputs == 1
            else (
                isinstance(out, tuple)
                and len(out) == n_outputs
                and all(isinstance(o, torch.Tensor) for o in out)
            )
        )
        if not ok:
            raise TypeError(
                f"register_op: {fn.__module__}.{fn.__qualname__} has no return annotation, so it must "
                f"return {want} (its annotation has {n_outputs} output(s)), but it returned "
                f"{_describe(out)}; annotate its return type (`-> ...`) to say what it returns"
            )
        return out

    checked.__signature__ = sig.replace(return_annotation=ret)  # type: ignore[attr-defined]
    try:
        schema = torch.library.infer_schema(checked, mutates_args=())
    except ValueError as e:  # an argument torch cannot type: say which function
        raise ValueError(f"register_op: {fn.__module__}.{fn.__qualname__}: {e}") from e
    return checked, schema


def _unaliased(fn: Callable) -> Callable:
    """`fn` with every output that is an input (or a view of one) cloned: a custom op may not return
    its inputs, and nnScaler 0.8's ops do (swin's `drop_path` returns `x` when its rate is 0)."""

    def aliases(out: Any, inputs: list[torch.Tensor]) -> bool:
        base = getattr(out, "_base", None)
        return any(out is i or (base is not None and (base is i or base is i._base)) for i in inputs)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        fix = [
            o.clone() if isinstance(o, torch.Tensor) and aliases(o, inputs) else o
            for o in (out if isinstance(out, tuple) else (out,))
        ]
        return tuple(fix) if isinstance(out, tuple) else fix[0]

    return call


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        inner = ", ".join(type(v).__name__ for v in value)
        return f"{type(value).__name__}({inner})"
    return type(value).__name__


def _wrap_function(fn: Callable, name: str, n_outputs: int = 1) -> Any:
    """Make a plain function a custom op: one node in the trace, autograd through torch.func.vjp."""
    if fn.__module__ == "__main__":
        raise ValueError(
            f"register_op: {fn.__qualname__} is defined in __main__; generated code must import it, so "
            "define it in an importable module"
        )
    impl, schema = _with_return_type(fn, n_outputs)
    impl = _unaliased(impl)
    op = torch.library.custom_op(f"{_NAMESPACE}::{name}", mutates_args=(), schema=schema)(impl)
    op.register_fake(impl)

    def setup_context(ctx, inputs, output):
        ctx.inputs = inputs

    def backward(ctx, *grads):
        # integer tensors (swin's relative_position_index) carry no gradient: constants of the vjp
        positions = [
            k for k, i in enumerate(ctx.inputs) if isinstance(i, torch.Tensor) and i.dtype.is_floating_point
        ]
        tensors = [ctx.inputs[k] for k in positions]

        def call(*ts):
            args = list(ctx.inputs)
            for k, t in zip(positions, ts):
                args[k] = t
            return fn(*args)

        with torch.enable_grad():
            _, vjp = torch.func.vjp(call, *[t.detach() for t in tensors])
            got = vjp(grads[0] if len(grads) == 1 else grads)
        out: list[Any] = [None] * len(ctx.inputs)
        for k, g in zip(positions, got):
            out[k] = g
        return tuple(out)

    op.register_autograd(backward, setup_context=setup_context)
    return op


def _param_names(op: Any) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(op).parameters)
    except (TypeError, ValueError):
        return ()


def _user_annotation(annotation: str, call: Any, params: tuple[str, ...]) -> tuple[str, dict[str, int]]:
    """The annotation fitted to this call's tensors, and the sizes nnScaler 0.8 reads from integer
    arguments named like an identifier (swin's `window_attn(..., h: int, ...)` sizes `(h+ dh^ 3)`)."""
    text = _fit_optional_inputs(annotation, call)
    idents = set(parse_annotation(text).identifiers())
    named = {**dict(zip(params, call.args)), **dict(call.kwargs)}
    sizes = {k: v for k, v in named.items() if k in idents and isinstance(v, int) and not isinstance(v, bool)}
    return text, sizes


def _identifier_args(params: tuple[str, ...]) -> Callable:
    """Local code's arguments: an integer argument named like a split identifier is divided by its
    pieces, as nnScaler 0.8 does (swin's `h` heads: each of 2 devices computes h // 2 heads)."""

    def local(args: tuple, kwargs: dict[str, Any], splits: dict[str, int]) -> tuple[tuple, dict[str, Any]]:
        def part(name: str, value: Any) -> Any:
            if name in splits and isinstance(value, int) and not isinstance(value, bool):
                return value // splits[name]
            return value

        named = [part(p, a) for p, a in zip(params, args)]
        return (*named, *args[len(named) :]), {k: part(k, v) for k, v in kwargs.items()}

    return local


def _fit_optional_inputs(annotation: str, call: Any) -> str:
    """nnScaler 0.8 writes one annotation input per positional argument, with '?' for an argument that
    may be a non-tensor (swin's `mask: Optional[Tensor]`); our annotations list tensor inputs only, so a
    '?' whose argument is not a graph value at this call (None, a number) is left out."""
    anno = parse_annotation(annotation)
    if len(anno.inputs) <= len(call.inputs):
        return annotation
    args = list(call.args) + list(call.kwargs.values())
    kept = [
        t
        for k, t in enumerate(anno.inputs)
        if t.dims is not None or (k < len(args) and any(True for _ in iter_refs(args[k])))
    ]
    return str(OpAnno(tuple(kept), anno.outputs))


def register_op(
    annotation: str,
    name: str | None = None,
    code_impl_pattern: str = "import",
    emit_fn: Callable | None = None,
    transform_rules: Any = None,
    input_gen_fn: Callable | None = None,
    *,
    family: str = "user",
) -> Callable:
    """Register `annotation` (e.g. '* h, * h -> * h') for a user op; usable as a decorator.

    Given a torch.library custom op, its rule is registered under the op's name; given a custom
    torch.autograd.Function, under its `Fn.apply` calls (split, they run on local shards). Given a plain
    function (with type hints on its arguments, in an importable module), it is first made into the
    custom op `torch.ops.nnscaler_user.<name>`, whose backward differentiates the function; the
    returned object is that op, callable like the function. Without a return hint (as nnScaler 0.8
    allows), the function returns a Tensor, or a tuple of k Tensors when the annotation has k outputs;
    a call that returns anything else raises, naming the function.

    nnScaler's other arguments: `code_impl_pattern` ('import' or 'source'): the generated code always
    imports the function from its module, so both work alike; `input_gen_fn` (inputs for profiling) is
    accepted and unused (the planner's cost model is analytic). `emit_fn(node, args, kwargs,
    runtime_devid, plan_ndevs, runtime_ndevs) -> str` writes the op's call in each rank's generated
    code: `args` / `kwargs` are the arguments already rendered as code (local names, literals),
    `node` the statement (`node.signature` is the default call target, `node.op`, `node.outputs`,
    `node.module_path`), `runtime_devid` the global rank; e.g. a ring attention passing its ranks.
    `transform_rules` is not supported and raises: an op splits along its annotation's dims.
    """
    if not isinstance(annotation, str):
        raise TypeError(
            f"register_op: the annotation must be a string such as '* h, * h -> * h', got "
            f"{type(annotation).__name__} (annotations computed by a function are not supported: use '*' "
            "for a variable number of leading dims)"
        )
    if code_impl_pattern not in ("import", "source"):
        raise ValueError(
            f"register_op: code_impl_pattern must be 'import' or 'source', got {code_impl_pattern!r}"
        )
    if emit_fn is not None and not callable(emit_fn):
        raise TypeError(f"register_op: emit_fn must be callable, got {type(emit_fn).__name__}")
    if transform_rules:
        raise NotImplementedError(
            "register_op(transform_rules=...) is not supported: an op splits along the dims its annotation "
            "marks splittable (see docs/annotations.md); express the split in the annotation"
        )
    n_outputs = len(parse_annotation(annotation).outputs)  # fails early on a malformed annotation

    def decorate(op: Any) -> Any:
        op_name = _op_name(op)
        target = op
        module = getattr(op, "__module__", None)
        if op_name is None:
            if not callable(op):
                raise TypeError(f"register_op expects a custom op or a function, got {type(op).__name__}")
            module = op.__module__
            target = _wrap_function(op, name or op.__name__, n_outputs)
            op_name = f"{_NAMESPACE}.{name or op.__name__}.default"
        params = _param_names(op)
        register_rule(
            OpRule(
                op_name,
                lambda call, _t=annotation: _user_annotation(_t, call, params),
                family,
                local_args=_identifier_args(params) if params else None,
            )
        )
        if emit_fn is not None:
            _EMITTERS[op_name] = emit_fn
        else:
            _EMITTERS.pop(op_name, None)
        if module and module != "__main__" and not module.startswith("torch"):
            _MODULES[op_name] = module
        return target

    return decorate
