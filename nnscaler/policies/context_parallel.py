"""Context parallelism: the sequence split over a mesh axis of its own, composed with a tensor-parallel plan.

The sequence split starts at the forward's inputs (the first dim, after the batch, whose size is the
attention's sequence length: token ids, labels, position ids) and flows through every op that keeps
tokens apart (linears, norms, elementwise, RoPE) as any split does (propagate.py). Attention is the
one op that mixes tokens: a split on its sequence runs the special `context_parallel_attention`
(graph/ops/attention.py), whose kernels (nnscaler.runtime.context_parallel) pass key/value blocks
around a ring or all-to-all the sequence to heads. Everything else a layout conversion handles (a
replicated tensor sliced locally, a gather where an op needs the whole sequence).

With tensor parallelism too, the stage's devices form the mesh (cp, tp): each node takes its
sequence split on axis 0 and its `tp` split on axis 1.
"""

from __future__ import annotations

from nnscaler.errors import PlanError
from nnscaler.graph.ir import Graph, Node, Shard, graph_fact, iter_refs
from nnscaler.graph.ops import BoundAnno, annotate_node, get_rule, layouts_for, mesh_layouts_for
from nnscaler.graph.ops.attention import CONTEXT_PARALLEL_ATTENTION
from nnscaler.graph.ops.leaf import is_leaf_op
from nnscaler.policies.cp_schedule import check_ring_nccl
from nnscaler.policies.options import ContextParallelOptions
from nnscaler.policies.plan import CP_KINDS, ContextParallel, NodePlan, Plan
from nnscaler.policies.propagate import PropagationState, best_follow, propagate

__all__ = ["context_parallel_of", "sequence_plans", "with_context_parallel", "attention_nodes"]


def _default_ulysses(cp: int) -> int:
    size = 1
    while size * 2 <= min(8, cp // 2) and cp % (size * 2) == 0:
        size *= 2
    return size


def context_parallel_of(opts: ContextParallelOptions) -> ContextParallel | None:
    """The ContextParallel the options ask for (None for cp_size 1)."""
    if opts.cp_size == 1:
        return None
    if opts.cp_kind not in CP_KINDS:
        raise PlanError(f"pas_config['cp_kind']={opts.cp_kind!r}: use one of {list(CP_KINDS)}")
    ulysses = 1
    if opts.cp_kind == "hybrid":
        ulysses = opts.cp_ulysses_size or _default_ulysses(opts.cp_size)
        if opts.cp_size % ulysses or ulysses in (1, opts.cp_size):
            raise PlanError(
                f"pas_config['cp_ulysses_size']={ulysses} with cp_size {opts.cp_size}: 'hybrid' needs a Ulysses "
                "group size that divides cp_size and lies strictly between 1 and cp_size (e.g. 2 for cp_size 4)"
            )
    return ContextParallel(opts.cp_size, opts.cp_kind, ulysses)


def attention_nodes(graph: Graph) -> list[Node]:
    """The attention nodes that may be split by sequence (self-attention: one sequence for q and k);
    once per graph (the planner asks for every configuration it costs)."""
    return list(graph_fact(graph, "attention_nodes", _attention_nodes))


def _attention_nodes(graph: Graph) -> tuple[Node, ...]:
    out = []
    for node in graph.nodes:
        rule = get_rule(node.op)
        if rule is None or not any(sp.emit == CONTEXT_PARALLEL_ATTENTION for sp in rule.specials.values()):
            continue
        bound = annotate_node(node, graph)
        if bound is not None and "s" in bound.sizes and bound.anno.inputs[1].dims[-2].ids[0] == "s":
            out.append(node)
    return tuple(out)


def _sequence_length(graph: Graph) -> int:
    nodes = attention_nodes(graph)
    if not nodes:
        raise PlanError(
            "pas_config['cp_size'] > 1 but the model has no self-attention (scaled_dot_product_attention with "
            "queries and keys of one sequence, or attention written as scores = q @ k^T (matmul, bmm, baddbmm or "
            "einsum), scale, bias or mask, softmax(-1), @ v, which capture turns into it) to split by sequence; "
            "drop cp_size"
        )
    lengths = {annotate_node(n, graph).sizes["s"] for n in nodes}
    if len(lengths) > 1:
        raise PlanError(
            f"context parallelism needs one sequence length for all attention; the model's are {sorted(lengths)}"
        )
    return lengths.pop()


class _SequenceDecider:
    """Split the sequence dim of the forward's inputs, and of what opaque regions return (embeddings an
    eager method merged, whole on every device); attention reading sequence shards runs the special."""

    def __init__(self, graph: Graph, ways: int, length: int):
        self.graph, self.ways, self.length = graph, ways, length
        leaf_outputs = {o for n in graph.nodes if is_leaf_op(n.op) for o in n.outputs}
        self.inputs = set(graph.inputs) | leaf_outputs

    def __call__(self, state: PropagationState, node: Node, bound: BoundAnno) -> NodePlan | None:
        rule = get_rule(node.op)
        if node.name in self._attention:
            q = state.input_layouts(node)[0]
            rank = len(self.graph.values[node.input_names()[0]].meta.shape)
            lay = layouts_for(bound, rule, "s", self.ways)
            if isinstance(lay, str):
                return None
            if isinstance(q, Shard) and q.dim == rank - 2:
                return NodePlan("s", self.ways, note="context parallel: sequence split")
            # an op before it needs the whole sequence (a state-space scan, windows rolled over the image):
            # each device slices its chunk of q, k and v locally, so the attention itself still splits
            return NodePlan(
                "s",
                self.ways,
                note="context parallel: sequence split at the attention (its inputs arrive whole)",
            )
        refs = [r for r in iter_refs((node.args, node.kwargs)) if self.graph.values[r.name].meta]
        for ref, t in zip(refs, bound.anno.inputs):
            shape = self.graph.values[ref.name].meta.shape
            if ref.name not in self.inputs or t.dims is None or len(shape) < 2:
                continue
            dims = [d for d in range(1, len(shape)) if shape[d] == self.length]
            if not dims:
                continue
            ident = t.dims[dims[0]].ids[0]
            if not isinstance(layouts_for(bound, rule, ident, self.ways), str):
                return NodePlan(ident, self.ways, note=f"context parallel: sequence of {ref.name}")
        return self._follow(state, node, bound, rule)

    def _follow(self, state: PropagationState, node: Node, bound: BoundAnno, rule) -> NodePlan | None:
        """As propagation would, except a sequence shard merged after a size that may change between
        calls (the batch of `(b s)`): its block count would be that size as traced, so the sequence is
        gathered first."""
        plan = best_follow(state, node, bound, allow_p2s=True)
        if not plan.is_split:
            return plan
        lay = layouts_for(bound, rule, plan.split, plan.ways, plan.blocks)
        for out, olay in zip(node.outputs, [] if isinstance(lay, str) else lay.outputs):
            meta = self.graph.values[out].meta
            if (
                isinstance(olay, Shard)
                and olay.blocks > 1
                and meta is not None
                and meta.sym
                and meta.sym[olay.dim]
            ):
                return NodePlan(
                    note="context parallel: sequence gathered before it is merged with a dynamic dim"
                )
        return plan

    def bind(self, attention: list[Node]) -> _SequenceDecider:
        self._attention = {n.name for n in attention}
        return self


def sequence_plans(graph: Graph, ways: int) -> dict[str, NodePlan]:
    """Every node's split of the sequence over `ways` devices (or replicate where it cannot follow)."""
    attention = attention_nodes(graph)
    decide = _SequenceDecider(graph, ways, _sequence_length(graph)).bind(attention)
    plans = propagate(graph, ways, decide, allow_partial_to_shard=True)
    missed = [n.name for n in attention if plans[n.name].split != "s"]
    if missed:
        raise PlanError(
            f"context parallelism: attention node(s) {', '.join(missed)} do not receive their queries split by "
            "sequence (an op before them needs the whole sequence); plan without cp_size or report the model"
        )
    return plans


def _check_kind(graph: Graph, cp: ContextParallel, tp_plan: Plan, length: int) -> None:
    chunks = 2 * cp.size if cp.kind == "zigzag" else cp.size
    if length % chunks:
        raise PlanError(
            f"cp_kind {cp.kind!r} over {cp.size} devices cuts the sequence into {chunks} equal chunks, but its "
            f"length is {length}; use a sequence length divisible by {chunks}"
        )
    if cp.kind not in ("ulysses", "hybrid"):
        return
    group = cp.size if cp.kind == "ulysses" else cp.ulysses_size
    for node in attention_nodes(graph):
        heads = graph.values[node.input_names()[0]].meta.shape[-3]
        tp = tp_plan.node(node.name)
        local = heads // tp.ways if tp.is_split and tp.split != "s" else heads
        if local % group:
            raise PlanError(
                f"cp_kind {cp.kind!r}: attention {node.name} ({node.source or 'unknown line'}) has {local} query "
                f"heads per tensor-parallel device, which {group} Ulysses devices do not divide; use cp_kind "
                "'zigzag' or a smaller cp_size"
            )


def _combine(node: Node, graph: Graph, seq: NodePlan, tp: NodePlan, mesh: tuple[int, ...]) -> NodePlan:
    """The node's sequence split on mesh axis 0 and its tp plan's splits (1-D or per axis) on the rest;
    the tp splits alone where both cannot hold at once (the sequence is then gathered for it)."""
    seq_split = (seq.split, seq.blocks) if seq.is_split else (None, 1)
    if tp.mesh_splits:
        tp_splits = tuple(tp.mesh_splits)
    else:
        tp_splits = ((tp.split, tp.blocks) if tp.is_split else (None, 1),)
    if seq_split[0] is None and all(ident is None for ident, _ in tp_splits):
        return NodePlan(note=tp.note)
    if seq_split[0] in {ident for ident, _ in tp_splits}:
        seq_split = (None, 1)
    bound = annotate_node(node, graph)
    splits = (seq_split, *tp_splits)
    if bound is None or isinstance(mesh_layouts_for(bound, get_rule(node.op), splits, mesh), str):
        splits = ((None, 1), *tp_splits)
    notes = "; ".join(n for n in (seq.note if splits[0][0] else "", tp.note) if n)
    return NodePlan(note=notes, mesh_splits=splits)


def with_context_parallel(graph: Graph, tp_plan: Plan, cp: ContextParallel) -> Plan:
    """`tp_plan` (split over each stage's tp devices, 1-D or on its own mesh) with the sequence split over
    `cp.size` more: the stage mesh becomes (cp, *tp mesh), or the sequence alone when the tp plan has one
    device per stage."""
    length = _sequence_length(graph)
    _check_kind(graph, cp, tp_plan, length)
    if cp.kind != "ulysses":  # the ring's P2P order, under NCCL's rules (cp_schedule.py)
        check_ring_nccl(cp.size // cp.ulysses_size, len(attention_nodes(graph)))
    seq = sequence_plans(graph, cp.size)
    tp_size = tp_plan.tp_size
    notes = (*tp_plan.notes, f"{cp.describe()} over mesh axis 0" if tp_size > 1 else cp.describe())
    if tp_size == 1:
        return Plan(
            tp_plan.policy,
            tp_plan.plan_ngpus * cp.size,
            seq,
            notes,
            tp_plan.recompute,
            tp_plan.pipeline,
            context_parallel=cp,
        )
    mesh = (cp.size, *(tp_plan.mesh or (tp_size,)))
    nodes = {n.name: _combine(n, graph, seq[n.name], tp_plan.node(n.name), mesh) for n in graph.nodes}
    return Plan(
        tp_plan.policy,
        tp_plan.plan_ngpus * cp.size,
        nodes,
        notes,
        tp_plan.recompute,
        tp_plan.pipeline,
        mesh=mesh,
        context_parallel=ContextParallel(cp.size, cp.kind, cp.ulysses_size, axis=0),
    )
