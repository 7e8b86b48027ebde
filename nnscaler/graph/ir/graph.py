"""The compiler's IR: a straight-line graph of aten-level ops over named values."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from nnscaler.graph.ir.frozen import FrozenDict

__all__ = [
    "TensorMeta",
    "SymExpr",
    "ShapeRule",
    "Value",
    "Ref",
    "Node",
    "Graph",
    "iter_refs",
    "map_refs",
    "sym_floordiv",
]


@dataclass(frozen=True)
class SymExpr:
    """A size computed at run time from the forward's input shapes, e.g. `idx_size0 * idx_size1`.

    `code` is a Python expression over the size names the generated forward binds from its inputs
    (Graph.size_names); `hint` is its value in the trace (what planning and cost estimates use).
    """

    code: str
    hint: int | float | bool

    def __str__(self) -> str:
        return self.code


def sym_floordiv(size: int | SymExpr, ways: int) -> int | SymExpr:
    """`size // ways` for a traced int or a run-time size (the plan checks divisibility first)."""
    if isinstance(size, SymExpr):
        simple = size.code.replace("_", "").replace("*", "").isalnum()
        code = size.code if simple else f"({size.code})"
        return SymExpr(f"{code} // {ways}", size.hint // ways)
    return size // ways


@dataclass(frozen=True)
class ShapeRule:
    """A condition on the input sizes that a call must meet: found when tracing or required by the plan.

    `code` is a Python boolean expression over size names; `why` says where it comes from.
    """

    code: str
    why: str


@dataclass(frozen=True)
class TensorMeta:
    """Description of a tensor: its traced shape, dtype name and whether it carries gradient.

    `sym` (None when every dim is fixed) gives, per dim, the Python expression of a size that may
    change between calls (None for a fixed dim); `shape` holds the traced values of all dims.
    """

    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool = False
    sym: tuple[str | None, ...] | None = None

    @property
    def is_float(self) -> bool:
        return self.dtype.startswith(("float", "bfloat", "complex"))

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class Value:
    """A tensor (or non-tensor) flowing through the graph; immutable (dataclasses.replace copies it).

    kind: 'input' (a forward argument), 'param', 'buffer', 'activation'.
    target: the forward argument name for inputs, the original state-dict name for params/buffers.
    aliases: further state-dict names of the same tensor (tied weights).
    """

    name: str
    meta: TensorMeta | None
    kind: str = "activation"
    producer: str | None = None
    target: str | None = None
    aliases: tuple[str, ...] = ()
    persistent: bool = True

    def __post_init__(self) -> None:
        if type(self.aliases) is not tuple:
            object.__setattr__(self, "aliases", tuple(self.aliases))

    @property
    def is_tensor(self) -> bool:
        return self.meta is not None


@dataclass(frozen=True)
class Ref:
    """A reference to a Value inside a node's args."""

    name: str


@dataclass(frozen=True)
class Node:
    """One op call. `op` is the aten overload name, e.g. 'aten.linear.default'.

    Immutable: `args` is a tuple, `kwargs` a FrozenDict and `outputs` a tuple (lists and dicts given
    to the constructor are converted). Structures nested inside args and kwargs (an op's list
    arguments, a leaf op's constants) keep the types the op is called with and are never changed.
    """

    name: str
    op: str
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    outputs: tuple[str, ...]
    source: str = ""
    module_path: str = ""
    module_class: str = ""
    no_grad: bool = False
    tuple_output: bool = False
    """The op returns a tuple/list (outputs are its items), e.g. split."""

    def __post_init__(self) -> None:
        _freeze_fields(self, _NODE_CONTAINERS)

    def input_names(self) -> list[str]:
        """Names of the values this node reads, in argument order (duplicates kept)."""
        return [r.name for r in iter_refs((self.args, self.kwargs))]


@dataclass(frozen=True, eq=False)
class Graph:
    """Ordered nodes plus the named values they read and write.

    Immutable after capture: fields cannot be assigned, sequences are tuples and mappings FrozenDicts
    (lists and dicts given to the constructor are converted). Code that derives a graph builds a new
    one (dataclasses.replace); capture builds with GraphBuilder. eq=False: a graph hashes and compares
    by identity, so facts derived from it can be cached per graph object (nnscaler.graph.ir.facts).
    """

    values: Mapping[str, Value] = field(default_factory=FrozenDict)
    nodes: tuple[Node, ...] = ()
    inputs: tuple[str, ...] = ()
    """User input values in forward-signature order."""
    forward_args: tuple[str, ...] = ()
    """Names of the forward arguments the graph was traced with (in signature order)."""
    outputs: tuple[Any, ...] = ()
    """Flat outputs (Refs or constants), unflattened with `out_spec`."""
    out_spec: str = ""
    """torch.utils._pytree treespec_dumps of the forward's output structure."""
    module_class: str = ""
    module_classes: Mapping[str, str] = field(default_factory=FrozenDict)
    """Module path -> class name, for every module the trace passed through."""
    input_leaves: tuple[str | None, ...] = ()
    """One entry per leaf of the flattened forward inputs: the value it feeds, or None (a constant)."""
    input_constants: Mapping[str, object] = field(default_factory=FrozenDict)
    """Leaf index (as a string) -> the non-tensor value traced there (baked into the code)."""
    untraced_args: Mapping[str, object] = field(default_factory=FrozenDict)
    """Forward parameters left at their (literal) defaults when traced: name -> default."""
    in_spec: str = ""
    """torch.utils._pytree treespec_dumps of ((), {forward arg: value}) as traced."""
    size_names: Mapping[str, list] = field(default_factory=FrozenDict)
    """Size name -> [input value, dim] where the generated forward reads it (dynamic shapes)."""
    shape_rules: tuple[ShapeRule, ...] = ()
    """Conditions on input sizes found when tracing (ranges, branches on sizes), checked at call time."""
    static_shapes: bool = False
    """Traced for constant_folding=True: the generated code folds every size it computes with into a
    constant (its traced value) and fixes those input dims; sizes only checked stay open."""
    constants: Mapping[str, Any] = field(default_factory=FrozenDict)
    """Tensors the forward creates from literals (`torch.tensor([...])`), by buffer target: their values
    (None after loading a saved graph: the values live in the output directory's constants.pt)."""

    def __post_init__(self) -> None:
        _freeze_fields(self, _GRAPH_CONTAINERS)

    def params(self) -> list[Value]:
        return [v for v in self.values.values() if v.kind == "param"]

    def buffers(self) -> list[Value]:
        return [v for v in self.values.values() if v.kind == "buffer"]

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def consumers(self) -> dict[str, list[Node]]:
        """Map value name -> nodes that read it (each node once)."""
        out: dict[str, list[Node]] = {name: [] for name in self.values}
        for n in self.nodes:
            for name in dict.fromkeys(n.input_names()):
                out[name].append(n)
        return out

    def output_names(self) -> list[str]:
        return [r.name for r in iter_refs(self.outputs)]


_NODE_CONTAINERS = {"args": tuple, "kwargs": FrozenDict, "outputs": tuple}
_GRAPH_CONTAINERS = {
    "values": FrozenDict,
    "nodes": tuple,
    "inputs": tuple,
    "forward_args": tuple,
    "outputs": tuple,
    "module_classes": FrozenDict,
    "input_leaves": tuple,
    "input_constants": FrozenDict,
    "untraced_args": FrozenDict,
    "size_names": FrozenDict,
    "shape_rules": tuple,
    "constants": FrozenDict,
}


def _freeze_fields(obj: Any, containers: dict[str, type]) -> None:
    """Convert the container fields of a just-made frozen dataclass to their immutable types."""
    for name, kind in containers.items():
        current = getattr(obj, name)
        if type(current) is not kind:
            object.__setattr__(obj, name, kind(current))


def iter_refs(obj: Any) -> Iterator[Ref]:
    """All Refs inside a nested structure of tuples, lists and dicts."""
    if isinstance(obj, Ref):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from iter_refs(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from iter_refs(item)


def map_refs(obj: Any, fn) -> Any:
    """Copy of a nested structure with each Ref replaced by fn(ref)."""
    if isinstance(obj, Ref):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(map_refs(x, fn) for x in obj)
    if isinstance(obj, list):
        return [map_refs(x, fn) for x in obj]
    if isinstance(obj, dict):
        return {k: map_refs(v, fn) for k, v in obj.items()}
    return obj
