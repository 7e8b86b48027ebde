"""The one op an opaque leaf module or method traces as (see leaf_modules.py for how leaves are chosen).

A leaf is named by a key: a submodule path (`model.visual`: its forward), or a method of a module
(`model.get_image_features()`, `scatter()` for a method of the top module: see `method_key`).
While tracing, a leaf module's `forward` (a leaf method: that method) is replaced by a call of the
torch.library op `nnscaler_leaf::call(str path, str spec, Tensor[] inputs, Tensor[] state) -> Tensor[]`:
`inputs` are the tensors among its arguments, `state` its parameters and buffers (a method's: those of
its module it was seen to use, `LeafSession.used`), so export lifts them under their original names and
the plan places them like any other weight; `spec` is a JSON text saying how to rebuild the call (the
arguments' pytree structure, their non-tensor values, the state's names). Its fake kernel gives the
output shapes: from a run of the module on the fake inputs where that works, else (output sizes that
depend on input values) from the module's real run on the dummy inputs, recorded before tracing
(`CallRecord`). The generated code never calls this op: it runs the module or method eagerly
(nnscaler.runtime.leaf).
"""

from __future__ import annotations

import contextlib
import json
import os
import traceback
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from nnscaler.errors import TraceError
from nnscaler.graph.ops.leaf import LEAF_OP

__all__ = [
    "LEAF_OP",
    "LeafUnsuitable",
    "CallRecord",
    "TensorSlot",
    "LeafSession",
    "describe_io",
    "leaf_session",
    "state_of",
    "method_key",
    "split_key",
    "BoundMethod",
    "restore_attributes",
]

_LITERALS = (type(None), bool, int, float, str)
_CONTAINERS = (tuple, list, dict)
_LIB: torch.library.Library | None = None


class LeafUnsuitable(TraceError):
    """A leaf module's forward takes or returns something other than (pytrees of) tensors and literals."""


@dataclass(frozen=True)
class CallRecord:
    """One real call of a module on the dummy inputs: its output structure and, per leaf, a tensor's
    (shape, dtype) or the literal value. `unsuitable`: why it cannot run as an opaque op ('' if it can)."""

    spec: Any
    leaves: tuple[Any, ...]
    unsuitable: str = ""


@dataclass(frozen=True)
class TensorSlot:
    """Where a tensor of this shape and dtype is among a call's outputs."""

    shape: tuple[Any, ...]
    dtype: torch.dtype


def describe_io(value: Any, what: str) -> str:
    """'' when `value` is a pytree of tensors and literals in tuples/lists/dicts, else what is not."""
    leaves, spec = pytree.tree_flatten(value)
    for leaf in leaves:
        if not isinstance(leaf, (torch.Tensor, *_LITERALS)):
            return f"{what} holds a {type(leaf).__name__}"
    if what == "its arguments":  # rebuilt in generated code: plain containers only
        bad = _foreign_containers(spec)
        if bad:
            return f"{what} hold a {bad}"
    return ""


def _foreign_containers(spec: pytree.TreeSpec) -> str:
    if spec.is_leaf():
        return ""
    if spec.type not in _CONTAINERS:
        return spec.type.__name__
    return next((b for c in _children(spec) if (b := _foreign_containers(c))), "")


def _children(spec: pytree.TreeSpec) -> list[pytree.TreeSpec]:
    """A treespec's child specs (`child(i)` in newer torch, `children_specs` before)."""
    if hasattr(spec, "child"):
        return [spec.child(i) for i in range(spec.num_children)]
    return list(spec.children_specs)


def state_of(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's parameters and buffers (relative names), in the order the op takes them."""
    return [*module.named_parameters(), *module.named_buffers()]


def method_key(owner: str, name: str) -> str:
    """The leaf key of method `name` of the module at path `owner` ('' for the top module)."""
    return f"{owner}.{name}()" if owner else f"{name}()"


def split_key(key: str) -> tuple[str, str | None]:
    """(module path, method name) of a leaf key; (path, None) for a leaf module (its forward)."""
    if not key.endswith("()"):
        return key, None
    owner, _, name = key[:-2].rpartition(".")
    return owner, name


class BoundMethod(torch.nn.Module):
    """`owner.<name>(...)` as a module's forward, so `torch.func.functional_call` can run a method on
    other tensors: its state is named `owner.<name in owner>`."""

    def __init__(self, owner: torch.nn.Module, name: str):
        super().__init__()
        self.owner = owner
        self.method = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # noqa: D102
        return getattr(self.owner, self.method)(*args, **kwargs)


@dataclass
class LeafSession:
    """The leaves of one capture: path -> module, and the real calls recorded on the dummy inputs."""

    leaves: dict[str, torch.nn.Module] = field(default_factory=dict)
    """Leaf key -> the module (a leaf method: the module that owns it)."""
    records: dict[str, list[CallRecord]] | None = None
    """None: no real run (meta weights or inputs); output sizes must follow from input sizes."""
    recorded: bool = False
    """Whether the real run was tried (`records` None after it: it cannot run)."""
    used: dict[str, list[str]] = field(default_factory=dict)
    """Leaf method key -> names (relative to its module) of the parameters and buffers the real run saw
    it use; a method missing here (no real run) takes all of its module's."""
    _counts: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    _structure: dict[tuple[str, int], tuple[Any, list[Any]]] = field(default_factory=dict)
    _eager: set[str] = field(default_factory=set)
    _value_reading: set[tuple[str, int]] = field(default_factory=set)
    called: set[str] = field(default_factory=set)
    """Leaves the trace called (a leaf never called leaves no op and needs no warning)."""
    fixed: set[str] = field(default_factory=set)
    """Leaves whose output sizes came from the real run (they depend on input values)."""

    def next_index(self, path: str, tensors: list[torch.Tensor]) -> int:
        """The call's number among this trace's calls of `path` (each torch.export has its fake mode)."""
        from torch._guards import detect_fake_mode

        key = detect_fake_mode(tensors) or self
        counts = self._counts.setdefault(key, {})
        counts[path] = counts.get(path, -1) + 1
        return counts[path]

    def state(self, key: str) -> list[tuple[str, torch.Tensor]]:
        """The leaf's parameters and buffers (names relative to its module), in the order the op takes them."""
        everything = state_of(self.leaves[key])
        if split_key(key)[1] is None or key not in self.used:
            return everything
        names = set(self.used[key])
        return [(n, t) for n, t in everything if n in names]

    def call(self, key: str, state: dict[str, torch.Tensor], args: tuple, kwargs: dict[str, Any]) -> Any:
        """Run the leaf's own code on `state` instead of its module's tensors."""
        module, method = self.leaves[key], split_key(key)[1]
        if method is None:
            return torch.func.functional_call(module, state, args, kwargs)
        named = {f"owner.{n}": t for n, t in state.items()}
        return torch.func.functional_call(BoundMethod(module, method), named, args, kwargs)

    def describe(self, key: str) -> str:
        """'model.visual (Qwen2VisionModel)' or 'model.get_image_features() (Qwen2VLModel.get_image_features)'."""
        module, method = self.leaves[key], split_key(key)[1]
        kind = type(module).__name__
        return f"{key} ({kind})" if method is None else f"{key} ({kind}.{method})"

    @contextlib.contextmanager
    def eager(self, path: str) -> Iterator[None]:
        """Inside, the leaf's forward is its own (for the probe run)."""
        self._eager.add(path)
        try:
            yield
        finally:
            self._eager.discard(path)


_ACTIVE: list[LeafSession] = []


@contextlib.contextmanager
def leaf_session(session: LeafSession) -> Iterator[None]:
    """Inside: every leaf of `session` traces as one `nnscaler_leaf::call` op."""
    _library()
    patched = []
    _ACTIVE.append(session)
    try:
        for path, module in session.leaves.items():
            attr = split_key(path)[1] or "forward"
            had = attr in module.__dict__
            original = getattr(module, attr)
            setattr(module, attr, _traced_forward(session, path, module, original))
            patched.append((module, attr, had, original))
        yield
    finally:
        restore_attributes(patched)
        _ACTIVE.remove(session)


def restore_attributes(patched: list[tuple[Any, str, bool, Any]]) -> None:
    """Undo `setattr(owner, name, ...)` patches, latest first: (owner, name, had it in its __dict__,
    original); an attribute the instance did not have itself is deleted, so its class's shows again."""
    for owner, name, had, original in reversed(patched):
        if had:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


def _traced_forward(session: LeafSession, path: str, module: torch.nn.Module, original):
    def forward(*args: Any, **kwargs: Any) -> Any:
        if session._eager:  # inside a leaf's own run (another leaf's too): its code, as written
            return original(*args, **kwargs)
        why = describe_io((args, kwargs), "its arguments")
        if why:
            raise LeafUnsuitable(
                f"{session.describe(path)} cannot run as an opaque op: {why}; only tensors, plain "
                "literals (None, bool, int, float, str) and tuples, lists and dicts of them can be passed"
            )
        flat, in_spec = pytree.tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        state = session.state(path)
        index = session.next_index(path, tensors + [t for _, t in state])
        session.called.add(path)
        spec = {
            "index": index,
            "in_spec": pytree.treespec_dumps(in_spec),
            "constants": {str(i): v for i, v in enumerate(flat) if not isinstance(v, torch.Tensor)},
            "state": [name for name, _ in state],
            "source": _caller_line(),
        }
        outs = torch.ops.nnscaler_leaf.call(path, json.dumps(spec), tensors, [t for _, t in state])
        out_spec, template = session._structure[(path, index)]
        it = iter(outs)
        return pytree.tree_unflatten(
            [next(it) if isinstance(x, TensorSlot) else x for x in template], out_spec
        )

    return forward


def _caller_line() -> str:
    """'file.py:12  code' of the user's line calling the leaf (the node's source in generated code)."""
    for frame in reversed(traceback.extract_stack()):
        if "/torch/" not in frame.filename and "/nnscaler/" not in frame.filename:
            return f"{os.path.basename(frame.filename)}:{frame.lineno}  {(frame.line or '').strip()}"
    return ""


def rebuild_call(spec: dict[str, Any], inputs: list[torch.Tensor]) -> tuple[tuple, dict[str, Any]]:
    """The (args, kwargs) a leaf was called with, from the op's `spec` and tensor inputs."""
    tree = pytree.treespec_loads(spec["in_spec"])
    it = iter(inputs)
    leaves = [
        spec["constants"][str(i)] if str(i) in spec["constants"] else next(it) for i in range(tree.num_leaves)
    ]
    args, kwargs = pytree.tree_unflatten(leaves, tree)
    return tuple(args), dict(kwargs)


def _library() -> torch.library.Library:
    global _LIB
    if _LIB is None:
        _LIB = torch.library.Library("nnscaler_leaf", "FRAGMENT")
        _LIB.define("call(str path, str spec, Tensor[] inputs, Tensor[] state) -> Tensor[]")
        _LIB.impl("call", _run_eagerly, "CompositeExplicitAutograd")
        torch.library.register_fake("nnscaler_leaf::call", _fake, lib=_LIB)
    return _LIB


def _session(path: str) -> LeafSession:
    for session in reversed(_ACTIVE):
        if path in session.leaves:
            return session
    raise TraceError(f"nnscaler_leaf::call of {path!r} outside a capture: generated code runs leaves eagerly")


def _run_eagerly(path: str, spec: str, inputs: list[torch.Tensor], state: list[torch.Tensor]) -> list:
    """The op on real tensors (not used by generated code, which calls the module itself)."""
    session, info = _session(path), json.loads(spec)
    args, kwargs = rebuild_call(info, list(inputs))
    with session.eager(path):
        out = session.call(path, dict(zip(info["state"], state)), args, kwargs)
    return [t.clone() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _fake(path: str, spec: str, inputs: list[torch.Tensor], state: list[torch.Tensor]) -> list:
    """Output shapes: a fake run of the module where it works, else its recorded real call."""
    session, info = _session(path), json.loads(spec)
    module = session.leaves[path]
    probe, failure = _probe(session, path, module, info, list(inputs), list(state))
    if probe is not None:
        leaves, out_spec = pytree.tree_flatten(probe)
        template = [TensorSlot(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t for t in leaves]
    else:
        record = _recorded(session, path, info["index"], failure)
        session.fixed.add(path)
        out_spec, template = record.spec, list(record.leaves)
    session._structure[(path, info["index"])] = (out_spec, template)
    device = next((t.device for t in [*inputs, *state]), torch.device("cpu"))
    return [torch.empty(x.shape, dtype=x.dtype, device=device) for x in template if isinstance(x, TensorSlot)]


def _probe(session, path, module, info, inputs, state) -> tuple[Any, str]:
    """(outputs of the module run on the fake inputs, '') or (None, why it could not run)."""
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    mode = detect_fake_mode([*inputs, *state])
    shape_env = getattr(mode, "shape_env", None)
    key = (path, info["index"])
    has_record = info["index"] < len((session.records or {}).get(path, []))
    if key in session._value_reading or (
        shape_env is not None
        and has_record
        and _reads_input_values(session, path, module, info, inputs, state)
    ):
        session._value_reading.add(key)  # the other traces of this call (other mode, retrace) skip both runs
        return None, "its output sizes depend on input values"
    ignore = shape_env.ignore_fresh_unbacked_symbols() if shape_env is not None else contextlib.nullcontext()
    args, kwargs = rebuild_call(info, inputs)
    try:
        with ignore, session.eager(path), _untracked_modules():
            out = session.call(path, dict(zip(info["state"], state)), args, kwargs)
    except Exception as exc:  # noqa: BLE001 - data-dependent sizes: the recorded real call decides
        return None, (str(exc).splitlines() or [type(exc).__name__])[0]
    why = describe_io(out, "its output")
    if why:
        raise LeafUnsuitable(f"{session.describe(path)} cannot run as an opaque op: {why}")
    for leaf in pytree.tree_leaves(out):
        if isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return None, "it returns a size computed from input values"
        if isinstance(leaf, torch.Tensor) and free_unbacked_symbols(leaf):
            return None, "its output sizes depend on input values"
    return out, ""


_VALUE_READS = ("DataDependentOutputException", "DynamicOutputShapeException", "GuardOnDataDependentSymNode")


def _reads_input_values(session, path, module, info, inputs, state) -> bool:
    """A cheaper first look (the traced sizes fixed, values unknown): do the module's output sizes depend
    on input values? Where they do, the symbolic run would only fail later and slower. Unsure: False."""
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
    from torch.fx.experimental.symbolic_shapes import ShapeEnv, free_unbacked_symbols

    def size(s: Any) -> int | None:
        return s if isinstance(s, int) else s.node.hint

    tensors = [*inputs, *state]
    shapes = [[size(s) for s in t.shape] for t in tensors]
    if any(s is None for shape in shapes for s in shape):
        return False
    with unset_fake_temporarily():
        metas = [torch.empty(shape, dtype=t.dtype, device="meta") for shape, t in zip(shapes, tensors)]
        shape_env = ShapeEnv()
        with FakeTensorMode(allow_non_fake_inputs=True, shape_env=shape_env) as mode:
            convert = mode.fake_tensor_converter.from_meta_and_device
            fakes = [convert(mode, m, t.device) for m, t in zip(metas, tensors)]
            args, kwargs = rebuild_call(info, fakes[: len(inputs)])
            try:
                with shape_env.ignore_fresh_unbacked_symbols(), session.eager(path), _untracked_modules():
                    out = session.call(path, dict(zip(info["state"], fakes[len(inputs) :])), args, kwargs)
            except Exception as exc:  # noqa: BLE001 - only value reads count
                text = f"{type(exc).__name__}: {exc}"
                return any(key in text for key in _VALUE_READS) or "data-dependent" in text
            leaves = pytree.tree_leaves(out)
            return any(
                isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool))
                or (isinstance(x, torch.Tensor) and bool(free_unbacked_symbols(x)))
                for x in leaves
            )


@contextlib.contextmanager
def _untracked_modules() -> Iterator[None]:
    """nn.Module calls and attribute reads as torch.fx's tracer found them (it patches both to record the
    module stack): the probe runs inside one traced op, not as calls the trace should see."""
    from torch.fx import _symbolic_trace as fx_trace

    plain = {
        "__call__": getattr(fx_trace, "_orig_module_call", None),
        "__getattr__": getattr(fx_trace, "_orig_module_getattr", None),
    }
    saved = {name: vars(torch.nn.Module)[name] for name, fn in plain.items() if fn is not None}
    try:
        for name in saved:
            setattr(torch.nn.Module, name, plain[name])
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.Module, name, fn)


def _quiet(failure: str) -> str:
    """The probe's failure, without torch's wording that would make the message read as a plain trace
    failure (the leaf already holds the data-dependent code)."""
    return "it reads them" if "data" in failure.lower() and "depend" in failure.lower() else failure[:200]


def _recorded(session: LeafSession, path: str, index: int, failure: str) -> CallRecord:
    calls = (session.records or {}).get(path, [])
    if index >= len(calls):
        where = (
            "the model cannot run on its dummy inputs (meta weights or inputs)"
            if session.records is None
            else f"the real run on the dummy inputs called it {len(calls)} time(s), the trace more"
        )
        kind = "module" if split_key(path)[1] is None else "method"
        raise TraceError(
            f"opaque leaf {kind} {path}: its output sizes depend on input values ({_quiet(failure)}) and {where}. "
            "Build the model with real weights and pass real dummy inputs, so nnscaler can run it once to "
            "learn them"
        )
    record = calls[index]
    if record.unsuitable:
        raise LeafUnsuitable(f"{session.describe(path)} cannot run as an opaque op: {record.unsuitable}")
    return record
