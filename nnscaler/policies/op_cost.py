"""What an op costs, independent of any device: forward FLOPs from its traced shapes, whether it
moves data at all, and per graph the FLOPs, weight bytes and saved activation bytes of every node and
the activation bytes crossing every place a pipeline stage could start.

autodist's cost model (policies/autodist/cost.py) turns these into times on a device; the pipeline
balancer (policies/stage_balance.py) uses them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

from nnscaler.graph.ir import Graph, Node, graph_fact
from nnscaler.graph.ops.einsum import einsum_flops

__all__ = [
    "DTYPE_BYTES",
    "dtype_bytes",
    "node_flops",
    "is_free_op",
    "GraphCosts",
    "graph_costs",
]

DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "bool": 1}
"""Bytes per element by dtype name (others: 4)."""


def dtype_bytes(dtype: str) -> int:
    return DTYPE_BYTES.get(dtype.replace("torch.", ""), 4)


_BIAS_FIRST = {"aten.addmm.default", "aten.baddbmm.default"}
_CONTRACTING = {
    "aten.linear.default": -1,
    "aten.mm.default": -1,
    "aten.matmul.default": -1,
    "aten.addmm.default": -1,
    "aten.bmm.default": -1,
    "aten.baddbmm.default": -1,
    "aten._grouped_mm.default": -1,
    "transformers.grouped_mm_fallback.default": -1,
}


_METADATA_OPS = {
    "view",
    "_unsafe_view",
    "reshape",
    "transpose",
    "permute",
    "unsqueeze",
    "squeeze",
    "expand",
    "slice",
    "select",
    "t",
    "alias",
    "split",
    "chunk",
    "detach",
    "unflatten",
    "flatten",
    "split_with_sizes",
    "unbind",
    "view_as",
    "expand_as",
    "narrow",
    "movedim",
    "_to_copy_noop",
}
"""Ops that only change a tensor's metadata (no kernel, no memory traffic) in the usual case."""


def is_free_op(node: Node, graph: Graph) -> bool:
    """True for views and for casts to the dtype the tensor already has."""
    parts = node.op.split(".")
    base = parts[1] if node.op.startswith("aten.") and len(parts) > 1 else node.op
    if base in _METADATA_OPS:
        return True
    if base == "to":
        ins = [graph.values[n].meta for n in node.input_names() if graph.values[n].meta is not None]
        outs = [graph.values[o].meta for o in node.outputs if graph.values[o].meta is not None]
        return bool(ins and outs) and ins[0].dtype == outs[0].dtype
    return False


def node_flops(node: Node, graph: Graph) -> float:
    """Forward FLOPs: 2 x output x contracted length for contractions, 4bhstd for attention, else output size."""
    outs = [graph.values[o].meta for o in node.outputs if graph.values[o].meta is not None]
    out = sum(m.numel for m in outs)
    ins = [graph.values[n].meta for n in node.input_names() if graph.values[n].meta is not None]
    if node.op == "aten.einsum.default" and ins:  # the summed letters need not be operand 0's last dim
        return einsum_flops(node.args[0], [m.shape for m in ins])
    if node.op in _CONTRACTING and ins and ins[0].shape:
        first = 1 if node.op in _BIAS_FIRST and len(ins) > 1 else 0  # addmm(bias, x, w)
        return 2.0 * out * ins[first].shape[-1]
    if node.op.startswith("aten.scaled_dot_product_attention") and len(ins) >= 3 and len(ins[1].shape) >= 2:
        q, k, v = ins[0].shape, ins[1].shape, ins[2].shape
        qn = ins[0].numel
        return 2.0 * qn * k[-2] + 2.0 * (qn // q[-1]) * k[-2] * v[-1]
    if node.op == "nnscaler.moe_experts.default" and len(ins) >= 5 and len(ins[4].shape) == 3:
        # every token's k experts: gate/up [2I, H] and down [H, I] matmuls, 6 T k H I
        return 6.0 * ins[1].numel * ins[4].shape[1] * ins[4].shape[2]
    if node.op.startswith("aten.conv") and len(ins) > 1 and ins[1].shape:
        w = ins[1].shape
        return 2.0 * out * (ins[1].numel // max(w[0], 1))
    return 1.0 * out  # a float, or a sympy expression for symbolic shapes (symbolic.flops_expr)


@dataclass(frozen=True)
class GraphCosts:
    """Per-node costs of a graph (index i: graph.nodes[i]) and per-boundary crossings (index i: the
    boundary just before node i; 0 and len(nodes) are the graph's ends)."""

    flops: tuple[float, ...]
    """Forward FLOPs (0 for views and no-op casts)."""
    param_bytes: tuple[float, ...]
    """Bytes of the weights (parameters and buffers) a node is the first to read."""
    act_bytes: tuple[float, ...]
    """Bytes of the outputs of ops that compute (kept for backward, as a first estimate)."""
    cross_bytes: tuple[float, ...]
    """Bytes of activations made before the boundary and read after it (what a stage starting there
    receives)."""
    cross_largest: tuple[float, ...]
    """Bytes of the largest single activation crossing the boundary."""
    cuttable: tuple[bool, ...]
    """A stage may start at the boundary: only tensors cross it (stages pass tensors only)."""

    def params_of(self, graph: Graph, starts: list[int]) -> list[float]:
        """Bytes of the distinct weights every stage reads (a weight two stages read, e.g. a tied
        embedding, counts for both)."""
        bounds = list(starts) + [len(graph.nodes)]
        out = []
        for a, b in zip(bounds, bounds[1:]):
            names = {r for n in graph.nodes[a:b] for r in n.input_names() if _is_weight(graph, r)}
            out.append(float(sum(_bytes(graph, r) for r in names)))
        return out


def _is_weight(graph: Graph, name: str) -> bool:
    return graph.values[name].kind in ("param", "buffer")


def _bytes(graph: Graph, name: str) -> float:
    meta = graph.values[name].meta
    return float(meta.numel * dtype_bytes(meta.dtype)) if meta is not None else 0.0


def _num(x) -> float:
    try:
        return float(x)
    except TypeError:  # a symbolic size: the cost of its traced value is not known here
        return 0.0


def graph_costs(graph: Graph) -> GraphCosts:
    """The graph's GraphCosts, computed once per graph."""
    return graph_fact(graph, "op_cost.graph_costs", _graph_costs)


def _graph_costs(graph: Graph) -> GraphCosts:
    n = len(graph.nodes)
    flops, params, acts = [0.0] * n, [0.0] * n, [0.0] * n
    seen: set[str] = set()
    produced: dict[str, int] = {}
    last_read: dict[str, int] = {}
    for i, node in enumerate(graph.nodes):
        free = is_free_op(node, graph)
        flops[i] = 0.0 if free else _num(node_flops(node, graph))
        for r in node.input_names():
            last_read[r] = i
            if _is_weight(graph, r) and r not in seen:
                seen.add(r)
                params[i] += _bytes(graph, r)
        for o in node.outputs:
            produced[o] = i
            if not free:
                acts[i] += _bytes(graph, o)
    for name in graph.output_names():
        last_read[name] = n
    starting: list[list[str]] = [[] for _ in range(n + 2)]
    ending: list[list[str]] = [[] for _ in range(n + 2)]
    for name, p in produced.items():
        last = last_read.get(name, -1)
        if last > p:  # alive across boundaries p + 1 .. last (the boundary before node `last`)
            starting[p + 1].append(name)
            ending[last + 1].append(name)
    cross, largest, cuttable = [], [], []
    alive: dict[str, float] = {}
    blocked = 0
    for i in range(n + 1):
        for name in ending[i]:
            blocked -= graph.values[name].meta is None
            alive.pop(name, None)
        for name in starting[i]:
            blocked += graph.values[name].meta is None
            alive[name] = _bytes(graph, name)
        inside = 0 < i < n
        cross.append(sum(alive.values()) if inside else 0.0)
        largest.append(max(alive.values(), default=0.0) if inside else 0.0)
        cuttable.append(blocked == 0 and i < n)
    return GraphCosts(tuple(flops), tuple(params), tuple(acts), tuple(cross), tuple(largest), tuple(cuttable))
