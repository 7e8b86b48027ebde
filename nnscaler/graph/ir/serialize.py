"""Graph <-> JSON. No pickle: a compiled artifact must be safe to load."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from typing import Any

from nnscaler.graph.ir.code_fields import check_code_fields
from nnscaler.graph.ir.graph import Graph, Node, Ref, ShapeRule, SymExpr, TensorMeta, Value
from nnscaler.graph.ir.mode import ModeValue

__all__ = ["graph_to_json", "graph_from_json", "encode_const", "decode_const"]


def encode_const(obj: Any) -> Any:
    """Encode an argument structure (Refs, scalars, dtypes, devices...) into JSON-able data."""
    import torch

    if isinstance(obj, Ref):
        return {"ref": obj.name}
    if isinstance(obj, SymExpr):
        return {"sym": [obj.code, obj.hint]}
    if isinstance(obj, ModeValue):
        return {"mode": [encode_const(obj.train), encode_const(obj.eval)]}
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        return {"float": repr(obj)}
    if isinstance(obj, tuple):
        return {"tuple": [encode_const(x) for x in obj]}
    if isinstance(obj, list):
        return [encode_const(x) for x in obj]
    if isinstance(obj, dict):
        return {"dict": {k: encode_const(v) for k, v in obj.items()}}
    if isinstance(obj, torch.dtype):
        return {"dtype": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.device):
        return {"device": obj.type}
    if isinstance(obj, torch.layout):
        return {"layout": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.memory_format):
        return {"memory_format": str(obj).removeprefix("torch.")}
    raise TypeError(f"cannot serialize argument {obj!r} of type {type(obj).__name__}")


def decode_const(obj: Any) -> Any:
    import torch

    if isinstance(obj, list):
        return [decode_const(x) for x in obj]
    if not isinstance(obj, dict):
        return obj
    ((key, val),) = obj.items()
    if key == "ref":
        return Ref(val)
    if key == "sym":
        return SymExpr(val[0], val[1])
    if key == "mode":
        return ModeValue(decode_const(val[0]), decode_const(val[1]))
    if key == "float":
        return float(val)
    if key == "tuple":
        return tuple(decode_const(x) for x in val)
    if key == "dict":
        return {k: decode_const(v) for k, v in val.items()}
    if key == "dtype":
        return getattr(torch, val)
    if key == "device":
        return torch.device(val)
    if key in ("layout", "memory_format"):
        return getattr(torch, val)
    raise ValueError(f"unknown encoded constant {obj!r}")


def graph_to_json(graph: Graph) -> str:
    data = {
        "module_class": graph.module_class,
        "forward_args": graph.forward_args,
        "inputs": graph.inputs,
        "values": [
            {**asdict(v), "meta": asdict(v.meta) if v.meta else None, "aliases": list(v.aliases)}
            for v in graph.values.values()
        ],
        "nodes": [
            {**asdict(n), "args": encode_const(n.args), "kwargs": encode_const(n.kwargs)} for n in graph.nodes
        ],
        "outputs": encode_const(list(graph.outputs)),  # a JSON list, as the traced outputs always were
        "out_spec": graph.out_spec,
        "module_classes": graph.module_classes,
        "input_leaves": graph.input_leaves,
        "in_spec": graph.in_spec,
        "untraced_args": graph.untraced_args,
        "input_constants": {k: encode_const(v) for k, v in graph.input_constants.items()},
        "size_names": graph.size_names,
        "shape_rules": [[r.code, r.why] for r in graph.shape_rules],
        "static_shapes": graph.static_shapes,
        "constants": sorted(graph.constants),  # names only: values are saved beside (constants.pt)
    }
    return json.dumps(data, indent=1)


def graph_from_json(text: str, where: str = "the graph") -> Graph:
    """The graph of `graph_to_json`; fields that codegen writes as code are checked to be plain
    names and size arithmetic (UnsafeGraphError naming `where` and the field otherwise)."""
    data = json.loads(text)
    values = {}
    for v in data["values"]:
        meta = v.pop("meta")
        values[v["name"]] = Value(meta=_meta_from_json(meta) if meta else None, **v)
    nodes = [
        Node(**{**n, "args": decode_const(n["args"]), "kwargs": decode_const(n["kwargs"])})
        for n in data["nodes"]
    ]
    g = Graph(
        values=values,
        nodes=nodes,
        inputs=data["inputs"],
        forward_args=data["forward_args"],
        outputs=decode_const(data["outputs"]),
        out_spec=data["out_spec"],
        module_class=data["module_class"],
        module_classes=data.get("module_classes", {}),
        input_leaves=data.get("input_leaves", []),
        input_constants={k: decode_const(v) for k, v in data.get("input_constants", {}).items()},
        untraced_args=data.get("untraced_args", {}),
        in_spec=data.get("in_spec", ""),
        size_names=data.get("size_names", {}),
        shape_rules=[ShapeRule(code, why) for code, why in data.get("shape_rules", [])],
        static_shapes=data.get("static_shapes", False),
        constants=dict.fromkeys(data.get("constants", [])),
    )
    check_code_fields(g, where)
    return g


def _meta_from_json(meta: dict) -> TensorMeta:
    sym = meta.get("sym")
    return TensorMeta(
        tuple(meta["shape"]), meta["dtype"], meta["requires_grad"], tuple(sym) if sym is not None else None
    )
