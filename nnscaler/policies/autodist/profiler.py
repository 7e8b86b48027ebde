"""Measured op costs (optional): time each op of a graph on this machine's device, at the local shapes
of its candidate splits, into a small JSON database; the cost model uses a measured time where it has
one and the analytic roofline elsewhere (pas_config['profile_db_path']).

    db = profile_graph(graph, ways=(1, 2))
    db.save("ops_cpu.json")

Ops whose local code is not the op on local shards (views with shape arguments, specials) and ops
that fail to run on random inputs are left to the analytic model.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nnscaler.graph.ir import Graph, Node, Ref, map_refs
from nnscaler.graph.ops import annotate_node, get_rule, layouts_for
from nnscaler.policies.autodist.choices import _local_shapes, _plans, op_key, tensor_refs
from nnscaler.policies.autodist.cost import is_free_op

__all__ = ["ProfileDB", "op_key", "local_shapes", "profile_graph"]


@dataclass
class ProfileDB:
    """Seconds of forward + backward per op key, measured on `device`."""

    device: str = "cpu"
    entries: dict[str, float] = field(default_factory=dict)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(
            json.dumps({"device": self.device, "entries": self.entries}, indent=1, sort_keys=True)
        )
        return path

    @classmethod
    def load(cls, path: str | Path) -> ProfileDB:
        data = json.loads(Path(path).read_text())
        return cls(data.get("device", "cpu"), {k: float(v) for k, v in data["entries"].items()})


def local_shapes(graph: Graph, refs: list[str], layouts, ways: int) -> list[tuple[int, ...]]:
    """Shapes one device sees of each tensor input under `layouts`."""
    return _local_shapes(graph, refs, layouts, ways)


def _tensor(meta, shape):
    dtype = getattr(torch, meta.dtype.replace("torch.", ""))
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype).requires_grad_(meta.requires_grad)
    return torch.zeros(shape, dtype=dtype)


def _time_once(fn, args, kwargs, grads: list[torch.Tensor], repeats: int) -> float:
    samples = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        outs = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, torch.Tensor)]
        loss = sum(o.float().sum() for o in outs if o.requires_grad)
        if grads and isinstance(loss, torch.Tensor):
            loss.backward()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples[1:])


def _measure(graph: Graph, node: Node, shapes: list[tuple[int, ...]], repeats: int) -> float | None:
    parts = node.op.split(".")
    try:
        fn = getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
    except (AttributeError, IndexError):
        return None
    refs = tensor_refs(graph, node)
    tensors = {r: _tensor(graph.values[r].meta, s) for r, s in zip(refs, shapes)}

    def value(ref: Ref):
        return tensors.get(ref.name)

    try:
        args = map_refs(node.args, value)
        kwargs = map_refs(node.kwargs, value)
        grads = [t for t in tensors.values() if t.requires_grad]
        return _time_once(fn, args, kwargs, grads, repeats)
    except Exception:  # shapes or arguments this op does not take at local sizes: analytic model
        return None


def profile_graph(
    graph: Graph, ways: tuple[int, ...] = (1,), repeats: int = 3, db: ProfileDB | None = None
) -> ProfileDB:
    """Measure every op of `graph` at the local shapes of each candidate split over each of `ways`."""
    db = db or ProfileDB("cuda" if torch.cuda.is_available() else "cpu")
    for node in graph.nodes:
        rule = get_rule(node.op)
        bound = annotate_node(node, graph)
        if rule is None or bound is None or rule.shape_args or is_free_op(node, graph):
            continue
        refs = tensor_refs(graph, node)
        out_meta = next((graph.values[o].meta for o in node.outputs if graph.values[o].meta), None)
        if out_meta is None:
            continue
        for w in ways:
            for plan in _plans(graph, node, bound, w):
                if plan.split is not None and rule.specials.get(plan.split) is not None:
                    continue
                lay = layouts_for(bound, rule, plan.split, plan.ways if plan.split else 1, plan.blocks)
                if isinstance(lay, str) or (plan.blocks > 1):
                    continue
                shapes = local_shapes(graph, refs, lay.inputs, plan.ways if plan.split else 1)
                key = op_key(node.op, shapes, out_meta.dtype)
                if key in db.entries:
                    continue
                t = _measure(graph, node, shapes, repeats)
                if t is not None:
                    db.entries[key] = t
    return db
