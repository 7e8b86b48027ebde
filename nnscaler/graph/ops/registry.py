"""The op registry: one annotation rule per aten op (or user op), split by op family."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nnscaler.graph.ir import Graph, Node, TensorMeta, iter_refs

__all__ = [
    "OpCall",
    "Special",
    "OpRule",
    "register_rule",
    "get_rule",
    "all_rules",
    "op_call",
    "rule",
    "fixed",
]


@dataclass(frozen=True)
class OpCall:
    """What an annotation rule sees of a node: its args and the metas of its tensor inputs/outputs."""

    node: Node
    inputs: list[TensorMeta]
    outputs: list[TensorMeta | None]

    @property
    def args(self) -> tuple[Any, ...]:
        return self.node.args

    @property
    def kwargs(self) -> dict[str, Any]:
        return self.node.kwargs

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        if index < len(self.node.args):
            return self.node.args[index]
        return self.node.kwargs.get(name, default)


@dataclass(frozen=True)
class Special:
    """A split whose local code is a runtime helper rather than the op on local shards.

    emit: name of the function in nnscaler.runtime.comm; output: layout of the result
    ('annotated' keeps what the annotation says, 'replicate' means the helper communicates inside).
    """

    emit: str
    output: str = "annotated"
    splits_fixed: bool = False
    """The identifier is `^` (a plain split would be wrong) but this special's local code makes a split
    on it right (context-parallel attention): only a policy asking for it by name gets it."""
    co_split: str | None = None
    """Another identifier split over the same devices whenever this special runs: tensors without the
    split identifier take this one's shard (expert parallelism: experts split, tokens stay with their
    rank); outputs follow it alone."""


@dataclass(frozen=True)
class OpRule:
    """How to split one op. `annotate(call)` returns an annotation string (or (string, sizes))."""

    op: str
    annotate: Callable[[OpCall], Any]
    family: str
    bias_input: int | None = None
    """Tensor input that is added once after the reduction when the op is split on a '+' dim."""
    mean_scale: bool | Callable[[OpCall], bool] = False
    """The op averages over its '+' dims: partial results are divided by the number of pieces."""
    specials: dict[str, Special] = field(default_factory=dict)
    """Identifier -> special local code when the op is split on that identifier."""
    shape_args: bool = False
    """The op takes its output shape as an argument (view, reshape, expand...): localised on split."""
    local_args: Callable[[tuple, dict[str, Any], dict[str, int]], tuple[tuple, dict[str, Any]]] | None = None
    """Non-tensor arguments that change when split (conv's groups): (args, kwargs, {identifier split:
    devices}) -> the local (args, kwargs)."""


_RULES: dict[str, OpRule] = {}


def register_rule(rule: OpRule) -> OpRule:
    _RULES[rule.op] = rule
    return rule


def get_rule(op: str) -> OpRule | None:
    return _RULES.get(op)


def all_rules() -> dict[str, OpRule]:
    return dict(_RULES)


def op_call(node: Node, graph: Graph) -> OpCall:
    ins = [graph.values[r.name].meta for r in iter_refs((node.args, node.kwargs))]
    outs = [graph.values[o].meta for o in node.outputs]
    return OpCall(node, [m for m in ins if m is not None], outs)


def rule(op: str | list[str], family: str, **options: Any) -> Callable[[Callable[[OpCall], Any]], Callable]:
    """Decorator registering `fn` as the annotation rule of one or several ops."""

    def deco(fn: Callable[[OpCall], Any]) -> Callable:
        for name in [op] if isinstance(op, str) else op:
            register_rule(OpRule(name, fn, family, **options))
        return fn

    return deco


def fixed(op: str | list[str], family: str, text: str, **options: Any) -> None:
    """Register a fixed annotation string."""
    for name in [op] if isinstance(op, str) else op:
        register_rule(OpRule(name, lambda call, _t=text: _t, family, **options))
