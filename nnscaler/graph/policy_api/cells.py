"""nnScaler 0.8's IR names (IRCell, IRFwOperation, IRDimops, IRSubTensor, ...) as read-only views of our
Graph's nodes and values, for policies written against nnScaler 0.8's policy API.

A view never changes the Graph: what a policy does to a node is recorded by the IRGraph front
(nnscaler.graph.policy_api.irgraph) and turned into a Plan by nnscaler.policies.policy_api08.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from nnscaler.graph.ir import Graph, Node, iter_refs
from nnscaler.graph.ops import BoundAnno, annotate_node, get_rule, layouts_for

__all__ = [
    "IRObject",
    "IRTensor",
    "IRFullTensor",
    "IRSubTensor",
    "IRCell",
    "IRFwOperation",
    "IRBpOperation",
    "IRDataOperation",
    "IRDimops",
    "IRGraphAnchor",
    "DimAlgorithm",
    "short_op_name",
]


def short_op_name(op: str) -> str:
    """nnScaler's node name for an op: 'aten.linear.default' -> 'linear', 'ns::window_attn' -> 'window_attn'."""
    parts = op.replace("::", ".").split(".")
    return parts[1] if len(parts) > 1 else parts[0]


class IRObject:
    """A value of the traced graph (nnScaler's IRObject)."""

    def __init__(self, name: str, graph: Graph) -> None:
        self.name = name
        self._graph = graph

    @property
    def tid(self) -> int:
        return list(self._graph.values).index(self.name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


class IRTensor(IRObject):
    """A traced tensor: shape, dtype, and whether it is a parameter or buffer (an attribute)."""

    @property
    def _value(self):
        return self._graph.values[self.name]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._value.meta.shape)

    @property
    def ndims(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return self.ndims

    @property
    def dtype(self) -> str:
        return self._value.meta.dtype

    @property
    def requires_grad(self) -> bool:
        return self._value.meta.requires_grad

    @property
    def grad(self) -> None:
        """nnScaler tracks gradient tensors in the graph; here autograd does (always None)."""
        return None

    def is_attr(self) -> bool:
        return self._value.kind in ("param", "buffer")

    def is_param(self) -> bool:
        return self._value.kind == "param"

    def is_buffer(self) -> bool:
        return self._value.kind == "buffer"

    def is_grad(self) -> bool:
        return False


class IRFullTensor(IRTensor):
    """The whole logical tensor of a value."""


class IRSubTensor(IRTensor):
    """A node's input or output; its `parent` is the full tensor (policies here see whole tensors)."""

    def __init__(self, name: str, graph: Graph, parent: IRFullTensor) -> None:
        super().__init__(name, graph)
        self.parent = parent


class IRCell:
    """An operation of the graph (nnScaler's IRCell)."""

    name: str = ""

    @staticmethod
    def get_objects_from_complex(obj: Any, _out: list | None = None) -> list:
        """The IRObjects inside nested lists, tuples and dicts, in order."""
        out = [] if _out is None else _out
        if isinstance(obj, IRObject):
            out.append(obj)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                IRCell.get_objects_from_complex(item, out)
        elif isinstance(obj, dict):
            for item in obj.values():
                IRCell.get_objects_from_complex(item, out)
        return out

    def isfw(self) -> bool:
        return True

    def isbw(self) -> bool:
        return False


class IRFwOperation(IRCell):
    """A forward op of the traced graph, or one piece of it after graph.partition / graph.replicate.

    origin: the traced node's name (the Plan's key); piece / pieces: which piece of how many.
    """

    def __init__(self, node: Node, owner: Any, cid: int, piece: int = 0, pieces: int = 1) -> None:
        """owner: the IRGraph holding the op (its traced graph and tensors)."""
        self._node = node
        self._owner = owner
        self.cid = cid
        self.piece = piece
        self.pieces = pieces
        self.is_piece = False
        """Made by graph.partition / graph.replicate (the traced op itself is not a piece)."""
        self.name = short_op_name(node.op)
        self.signature = node.op
        self.comment: str | None = None
        self.recompute: int | None = None
        self.mirror = None
        self._device: int | None = None

    @property
    def origin(self) -> str:
        return self._node.name

    @property
    def device(self) -> tuple[int, ...]:
        """The device it was assigned to: () until graph.assign."""
        return () if self._device is None else (self._device,)

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self._node.kwargs)

    @property
    def module_stack(self) -> dict[str, str]:
        """Enclosing module paths (outermost first) -> class names."""
        path, classes, out = self._node.module_path, self._owner.traced.module_classes, {}
        parts = path.split(".") if path else []
        for k in range(1, len(parts) + 1):
            prefix = ".".join(parts[:k])
            out[prefix] = classes.get(prefix, "")
        return out

    def _tensor_names(self) -> list[str]:
        graph = self._owner.traced
        return [r.name for r in iter_refs((self._node.args, self._node.kwargs)) if graph.values[r.name].meta]

    def inputs(self) -> tuple[IRSubTensor, ...]:
        """Tensor inputs in argument order (the order of the op's annotation)."""
        return tuple(self._owner.sub_tensor(n) for n in self._tensor_names())

    def input(self, index: int) -> IRSubTensor:
        return self.inputs()[index]

    def outputs(self) -> tuple[IRSubTensor, ...]:
        graph = self._owner.traced
        return tuple(self._owner.sub_tensor(n) for n in self._node.outputs if graph.values[n].meta)

    def output(self, index: int) -> IRSubTensor:
        return self.outputs()[index]

    def algorithm(self, tag: str) -> DimAlgorithm:
        """nnScaler's partition algorithms; 'dim' (split one annotated dim) is the one policies use."""
        if tag != "dim":
            raise ValueError(f"{self.name}.algorithm({tag!r}): only algorithm('dim') is supported")
        bound = annotate_node(self._node, self._owner.traced)
        if bound is None:
            raise ValueError(
                f"{self.name} ({self.signature}) has no dim annotation: it cannot be partitioned"
            )
        return DimAlgorithm(self, bound)

    def __repr__(self) -> str:
        part = f" piece {self.piece}/{self.pieces}" if self.pieces > 1 else ""
        return f"{type(self).__name__}({self.origin}: {self.name}{part}, device={list(self.device)})"


class IRDimops(IRFwOperation):
    """A forward op with a dim annotation (it can be partitioned)."""

    @property
    def anno(self):
        bound = annotate_node(self._node, self._owner.traced)
        return None if bound is None else bound.anno

    def transform_space(self) -> list[tuple[int, int]]:
        """(input index, dim) pairs a 'dim' partition may split: dims not marked '^' or fixed-size."""
        bound = annotate_node(self._node, self._owner.traced)
        out = []
        for idx, t in enumerate(bound.anno.inputs):
            for dim, d in enumerate(t.dims or ()):
                ident = d.ids[0]
                if bound.anno.flag_of(ident) != "^" and ident in bound.sizes:
                    out.append((idx, dim))
        return out


class IRBpOperation(IRCell):
    """A backward op: the generated code's autograd derives backward, so graphs here hold none."""


class IRDataOperation(IRCell):
    """The data loader: batches are given to the module, so graphs here hold none."""


class IRGraphAnchor(IRFwOperation):
    """nnscaler.anchor(name) markers: our capture keeps none (stages start at module boundaries)."""


class DimAlgorithm:
    """node.algorithm('dim'): split input `idx`'s dim `dim` into `num` pieces (and every dim sharing its
    annotation identifier with it)."""

    def __init__(self, node: IRFwOperation, bound: BoundAnno) -> None:
        self.node = node
        self._bound = bound

    def identifier(self, idx: int, dim: int) -> str:
        """The annotation identifier of input `idx`'s dim `dim` (the first one of a composite `(h d)`)."""
        inputs = self._bound.anno.inputs
        if not 0 <= idx < len(inputs) or not inputs[idx].dims:
            raise ValueError(
                f"{self.node.name}: input {idx} is not an annotated tensor in '{self._bound.anno}'"
            )
        dims = inputs[idx].dims
        if not -len(dims) <= dim < len(dims):
            raise ValueError(f"{self.node.name}: input {idx} has {len(dims)} dims, got dim={dim}")
        return dims[dim].ids[0]

    def why_not(self, idx: int, dim: int, num: int) -> str | None:
        """Why this split is impossible, or None when it is possible."""
        try:
            ident = self.identifier(idx, dim)
        except ValueError as exc:
            return str(exc)
        if not isinstance(num, int) or num < 1:
            return f"num must be an int >= 1, got {num!r}"
        rule = get_rule(self.node.signature)
        result = layouts_for(self._bound, rule, ident, num)
        return result if isinstance(result, str) else None

    def satisfy(self, idx: int, dim: int, num: int, **_: Any) -> bool:
        return self.why_not(idx, dim, num) is None


def flatten_types(ntype: type | Iterable[type] | None) -> tuple[type, ...] | None:
    """isinstance's second argument from nnScaler's `ntype=` (a type or a tuple of types)."""
    if ntype is None:
        return None
    return (ntype,) if isinstance(ntype, type) else tuple(ntype)
