"""The mutable twin of Graph that capture and loading fill in, then freeze with `build()`."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from nnscaler.graph.ir.graph import Graph, Node, ShapeRule, Value

__all__ = ["GraphBuilder"]


@dataclass
class GraphBuilder:
    """Graph's fields as plain lists and dicts (see Graph for what each holds), to append to while a
    graph is being made; `build()` returns the immutable Graph. Nothing else ever edits a graph."""

    values: dict[str, Value] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)
    forward_args: list[str] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)
    out_spec: str = ""
    module_class: str = ""
    module_classes: dict[str, str] = field(default_factory=dict)
    input_leaves: list[str | None] = field(default_factory=list)
    input_constants: dict[str, object] = field(default_factory=dict)
    untraced_args: dict[str, object] = field(default_factory=dict)
    in_spec: str = ""
    size_names: dict[str, list] = field(default_factory=dict)
    shape_rules: list[ShapeRule] = field(default_factory=list)
    static_shapes: bool = False
    constants: dict[str, Any] = field(default_factory=dict)

    def build(self) -> Graph:
        """The frozen Graph of what was filled in (the builder's containers are copied)."""
        return Graph(**{f.name: getattr(self, f.name) for f in fields(Graph)})
