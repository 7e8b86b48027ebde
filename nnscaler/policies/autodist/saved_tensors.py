"""What autograd keeps for backward: a table of the tensors each op kind saves (with the reason),
and, for a graph, the bytes each node's outputs hold while the step waits for backward.

Rules follow PyTorch's derivatives.yaml and the kernels' own saves. A value is counted once (however
many consumers save it), at its storage (a view or a no-op cast saves its base: the base stays alive),
and nothing inside a recomputed module is kept except the module's inputs (torch.utils.checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass

from nnscaler.graph.ir import Graph, Node
from nnscaler.policies.autodist.memo import graph_memo
from nnscaler.policies.op_cost import is_free_op

__all__ = ["SavedRule", "SAVED", "rule_for", "Kept", "kept_bytes_plan", "region_of", "recompute_peak"]


@dataclass(frozen=True)
class SavedRule:
    """The tensors one op kind saves: tensor-input slots, output indices, and extra buffers."""

    inputs: tuple[int, ...] | str = ()
    """Tensor-input slots saved ('all': every tensor input; 'other': for a binary op, the slot whose
    partner needs a gradient)."""
    outputs: tuple[int, ...] = ()
    extra: tuple[str, float, int] | None = None
    """An extra buffer: ('out' | 'in', elements per element of output 0 / tensor input 0, bytes per
    element, 0: the value's own element size)."""
    reason: str = ""


_IN = SavedRule("all", reason="backward multiplies the output gradient by the inputs (or reads them)")
_NONE = SavedRule(reason="the gradient is the output gradient (or a reshaping of it): nothing saved")
_OUT = SavedRule(outputs=(0,), reason="the derivative is a function of the output")
_OTHER = SavedRule("other", reason="d(a*b)/da = b: each input saved for the other's gradient")

SAVED: dict[str, SavedRule] = {
    **dict.fromkeys(
        ("linear", "mm", "bmm", "matmul", "addmm", "baddbmm", "addbmm", "einsum", "mv", "tensordot"),
        SavedRule("all", reason="matmul saves its operands (the weight is a parameter, counted apart)"),
    ),
    **dict.fromkeys(("conv1d", "conv2d", "conv3d", "convolution", "conv_transpose2d"), _IN),
    **dict.fromkeys(("add", "sub", "neg", "cat", "stack", "clone", "contiguous", "sum", "mean"), _NONE),
    **dict.fromkeys(("to", "_to_copy", "type_as", "float", "half", "bfloat16", "copy", "pad"), _NONE),
    **dict.fromkeys(("constant_pad_nd", "repeat", "roll", "flip", "new_zeros", "zeros_like"), _NONE),
    **dict.fromkeys(("mul", "div"), _OTHER),
    **dict.fromkeys(("relu", "threshold", "sigmoid", "tanh", "exp", "sqrt", "rsqrt", "hardtanh"), _OUT),
    **dict.fromkeys(("softmax", "_softmax", "log_softmax", "_log_softmax"), _OUT),
    **dict.fromkeys(("gelu", "silu", "mish", "pow", "log", "sin", "cos", "abs", "erf", "square"), _IN),
    **dict.fromkeys(
        ("layer_norm", "native_layer_norm", "rms_norm", "group_norm", "batch_norm", "native_batch_norm"),
        SavedRule("all", extra=("in", 0.0, 4), reason="norms save their input and fp32 mean/rstd per row"),
    ),
    **dict.fromkeys(
        ("dropout", "native_dropout", "feature_dropout"),
        SavedRule(extra=("out", 1.0, 1), reason="dropout keeps a one-byte mask per element (none at p=0)"),
    ),
    "embedding": SavedRule((1,), reason="the indices, to scatter the gradient rows"),
    "scaled_dot_product_attention": SavedRule(
        (0, 1, 2),
        (0,),
        reason="flash/efficient kernels keep q, k, v, the output and the per-row logsumexp, not the scores",
    ),
    "cross_entropy_loss": SavedRule(
        (1,),
        extra=("in", 1.0, 0),
        reason="log_softmax's output (one logits-sized tensor) and the targets",
    ),
    "mse_loss": SavedRule("all", reason="the gradient is 2 (input - target)"),
    "nll_loss": SavedRule((1,), reason="the targets (the input gradient is a scatter of them)"),
    **dict.fromkeys(("gather", "index_select", "index"), SavedRule((1,), reason="the indices")),
    **dict.fromkeys(("masked_fill", "where"), SavedRule((0,), reason="the mask/condition")),
}
"""Op base name (aten.<name>.<overload>) -> what it saves."""

_UNKNOWN = SavedRule("all", outputs=(), reason="unknown op: assume its backward reads its inputs")


def rule_for(node: Node) -> SavedRule:
    """The rule of `node`'s op (by aten base name; unknown ops save their inputs)."""
    parts = node.op.split(".")
    base = parts[1] if node.op.startswith("aten.") and len(parts) > 1 else node.op
    if base in ("dropout", "native_dropout", "feature_dropout") and _dropout_p(node) == 0.0:
        return SavedRule(reason="dropout at p=0 returns its input")
    return SAVED.get(base, _UNKNOWN)


def _dropout_p(node: Node) -> float | None:
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p")
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    if train is False:
        return 0.0
    return float(p) if isinstance(p, (int, float)) else None


def region_of(module_path: str, recompute: tuple[str, ...]) -> str | None:
    """The recomputed module (a recompute path) `module_path` runs in, or None."""
    for r in recompute:
        if r == "" or module_path == r or module_path.startswith(r + "."):
            return r
    return None


@dataclass(frozen=True)
class Kept:
    """What one node's outputs keep alive for backward: output indices held whole (their storage is
    kept), and extra buffers as ('in' | 'out', the tensor input slot or output index whose layout and
    batch scaling they follow, elements at the traced batch, bytes per element; 0: the dtype's)."""

    outputs: tuple[int, ...] = ()
    extras: tuple[tuple[str, int, float, int], ...] = ()


def kept_bytes_plan(graph: Graph, recompute: tuple[str, ...] = ()) -> dict[str, Kept]:
    """Node name -> Kept: each saved value counted once, at the node producing its storage."""
    memo = graph_memo(graph).setdefault("kept_plan", {})
    if recompute not in memo:
        memo[recompute] = _plan(graph, recompute)
    return memo[recompute]


def _roots(graph: Graph) -> dict[str, str]:
    """Value -> the value owning its storage (a view's or a no-op cast's base); once per graph."""
    memo = graph_memo(graph)
    if "storage_roots" not in memo:
        root: dict[str, str] = {}
        for node in graph.nodes:
            ins = [r for r in node.input_names() if graph.values[r].meta is not None]
            aliases = is_free_op(node, graph) or rule_for(node).reason.startswith("dropout at p=0")
            for o in node.outputs:
                root[o] = root.get(ins[0], ins[0]) if aliases and ins else o
        memo["storage_roots"] = root
    return memo["storage_roots"]


def _saved_by(graph: Graph, node: Node, root: dict[str, str]) -> tuple[set[str], tuple | None]:
    """(storages `node` saves for backward, its extra buffer or None), recompute aside."""
    if not _needs_grad(graph, node) or is_free_op(node, graph):  # a view's backward reshapes
        return set(), None
    refs = [r for r in node.input_names() if graph.values[r].meta is not None]
    rule = rule_for(node)
    saved = {root.get(r, r) for r in _saved_inputs(graph, rule, refs)}
    saved |= {root.get(node.outputs[i], node.outputs[i]) for i in rule.outputs if i < len(node.outputs)}
    extra = _extra(graph, node, rule, refs) if rule.extra is not None and node.outputs else None
    return saved, extra


def _plan(graph: Graph, recompute: tuple[str, ...]) -> dict[str, Kept]:
    index = {n.name: n for n in graph.nodes}
    root = _roots(graph)
    saved: set[str] = set()
    extras: dict[str, list[tuple[str, int, float, int]]] = {}
    for node in graph.nodes:
        region = region_of(node.module_path, recompute)
        if region is not None:  # checkpoint keeps the region's inputs only
            for r in node.input_names():
                producer = graph.values[r].producer
                if graph.values[r].meta is None:
                    continue
                if producer is None or region_of(index[producer].module_path, recompute) != region:
                    saved.add(root.get(r, r))
            continue
        mine, extra = _saved_by(graph, node, root)
        saved |= mine
        if extra is not None:
            extras.setdefault(node.name, []).append(extra)
    out: dict[str, Kept] = {}
    for node in graph.nodes:
        kept = tuple(
            i
            for i, o in enumerate(node.outputs)
            if o in saved and root.get(o) == o and graph.values[o].kind not in ("param", "buffer")
        )
        if kept or node.name in extras:
            out[node.name] = Kept(kept, tuple(extras.get(node.name, ())))
    return out


def _needs_grad(graph: Graph, node: Node) -> bool:
    """Autograd records the node (some output needs a gradient)."""
    metas = [graph.values[o].meta for o in node.outputs]
    return any(m is not None and m.requires_grad for m in metas)


def _saved_inputs(graph: Graph, rule: SavedRule, refs: list[str]) -> list[str]:
    acts = [r for r in refs if graph.values[r].kind not in ("param", "buffer")]
    if rule.inputs == "all":
        return acts
    if rule.inputs == "other":
        grads = [bool(graph.values[r].meta.requires_grad) for r in refs]
        keep = [refs[1 - k] for k in range(min(len(refs), 2)) if grads[k] and len(refs) == 2]
        return [r for r in keep if r in acts]
    return [refs[i] for i in rule.inputs if i < len(refs) and refs[i] in acts]


def _extra(graph: Graph, node: Node, rule: SavedRule, refs: list[str]) -> tuple[str, int, float, int]:
    """An extra buffer (see Kept.extras)."""
    kind, per, size = rule.extra
    if kind == "out" or not refs:
        return ("out", 0, graph.values[node.outputs[0]].meta.numel * per, size)
    src = graph.values[refs[0]].meta
    if per == 0.0:  # per-row statistics (mean and rstd): two fp32 per row of the last dim
        rows = src.numel // max(src.shape[-1], 1) if src.shape else 1
        return ("in", 0, 2.0 * rows, size)
    return ("in", 0, src.numel * per, size)


def recompute_peak(graph: Graph, recompute: tuple[str, ...], ctx) -> float:
    """Bytes per device one recomputed module holds again while its backward runs (its forward rerun
    saves what it would without recompute): the largest over the recomputed module instances, split
    over ctx.ways devices like the transient buffers (context.transient_bytes)."""
    if not recompute:
        return 0.0
    index = {n.name: n for n in graph.nodes}
    root = _roots(graph)
    saved: dict[str, set[str]] = {}
    extra_bytes: dict[str, float] = {}
    for node in graph.nodes:
        region = region_of(node.module_path, recompute)
        if region is None:
            continue
        mine, extra = _saved_by(graph, node, root)
        saved.setdefault(region, set()).update(mine)
        if extra is not None:
            side, i, elems, size = extra
            refs = [r for r in node.input_names() if graph.values[r].meta is not None]
            ref = refs[i] if side == "in" else node.outputs[i]
            meta = graph.values[ref].meta
            b = elems * (size or ctx.elem_bytes(meta.dtype)) * ctx.value_scale(graph, ref)
            extra_bytes[region] = extra_bytes.get(region, 0.0) + b
    per = []
    for region, values in saved.items():
        inside = [  # what the rerun makes (its inputs are kept anyway, counted as activations)
            v
            for v in values
            if graph.values[v].producer is not None
            and region_of(index[graph.values[v].producer].module_path, recompute) == region
            and graph.values[v].kind not in ("param", "buffer")
        ]
        per.append(sum(ctx.value_bytes(graph, v) for v in inside) + extra_bytes.get(region, 0.0))
    return max(per, default=0.0) / max(ctx.ways, 1)
