"""The IR: graph, values, nodes, JSON serialization and invariants. A leaf package."""

from nnscaler.graph.ir.builder import GraphBuilder
from nnscaler.graph.ir.code_fields import UnsafeGraphError, check_code_fields
from nnscaler.graph.ir.facts import graph_fact, graph_facts
from nnscaler.graph.ir.frozen import FrozenDict
from nnscaler.graph.ir.graph import (
    Graph,
    Node,
    Ref,
    ShapeRule,
    SymExpr,
    TensorMeta,
    Value,
    iter_refs,
    map_refs,
    sym_floordiv,
)
from nnscaler.graph.ir.layout import (
    Layout,
    MeshLayout,
    Partial,
    Placement,
    Replicate,
    Shard,
    layout_from_json,
    layout_to_json,
    mesh_coords,
    mesh_layout,
    placements_of,
    split_factors,
    storage_shard,
)
from nnscaler.graph.ir.mode import ModeValue
from nnscaler.graph.ir.redistribute import AxisMove, redistribute_moves
from nnscaler.graph.ir.serialize import decode_const, encode_const, graph_from_json, graph_to_json
from nnscaler.graph.ir.subgraph import Piece, cut_graph
from nnscaler.graph.ir.verify import verify

__all__ = [
    "Graph",
    "GraphBuilder",
    "FrozenDict",
    "graph_facts",
    "graph_fact",
    "Node",
    "Ref",
    "TensorMeta",
    "SymExpr",
    "ModeValue",
    "ShapeRule",
    "sym_floordiv",
    "Value",
    "iter_refs",
    "map_refs",
    "graph_to_json",
    "graph_from_json",
    "encode_const",
    "decode_const",
    "verify",
    "check_code_fields",
    "UnsafeGraphError",
    "Piece",
    "cut_graph",
    "Layout",
    "Partial",
    "Replicate",
    "Shard",
    "MeshLayout",
    "AxisMove",
    "redistribute_moves",
    "Placement",
    "mesh_coords",
    "mesh_layout",
    "placements_of",
    "split_factors",
    "storage_shard",
    "layout_to_json",
    "layout_from_json",
]
