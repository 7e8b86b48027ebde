"""The `tp` policy: Megatron-style tensor parallelism, found by pattern rather than by search.

A weight-carrying linear (or grouped expert matmul, or convolution) whose input arrives sharded on
its reduction dim is row-parallel: partial sums, one all-reduce. Otherwise it is column-parallel
(output features split) when that split flows to a row-parallel consumer, a loss or the outputs with
no communication on the way; flow.py replays propagation downstream to check, so a split that would
cut through a head is never taken. A fused projection tries the splits its downstream reshape allows
(blocks.py), so each device keeps whole heads: the chunks it is cut into (GPT-2's q, k, v), then its
outer sub-dims whole, then inner ones taken in every block (nn.MultiheadAttention's packed
"(3 (heads head_dim))" rows split by heads in 3 blocks; Falcon's grouped "(kv_groups (q_per_kv + 2)
head_dim)" rows split by KV group, each device keeping its groups' query heads and their K/V head).
When none flows cleanly but the output still feeds a linear or the loss, or the op is a convolution
(compute-heavy: a ViT's patch embedding, read by a layer norm), the weight is split and its output
all-gathered at once, read whole downstream (Megatron's `gather_output`); otherwise the weight stays
whole. A convolution with a bias is row-parallel like a linear (the bias added once, after the
all-reduce), so conv -> group norm -> activation -> conv pairs are column -> row parallel. Either
way the plan's note names the op that needed the output whole.

Attention whose inputs all arrive whole is split by query heads when that flows to a row-parallel
output projection: each device slices its query heads locally and reads the K/V heads whole. This is
multi-query attention (Falcon's `multi_query`): the fused projection holds the query heads and one
K/V head every device needs, so no split of it flows cleanly (a weight with some rows split and
others replicated has no layout); it is split with its output gathered, and the attention, the
output projection and the MLP split as usual.

Token embeddings split the vocabulary, and a loss over vocab-sharded logits becomes vocab-parallel
cross entropy. Every other op follows its inputs (see propagate.py).

Parallel blocks (Falcon, GPT-J: attention and MLP read the same norm output; their outputs are summed
with the residual) need nothing special: both branches are column -> row parallel, the norm output's
gradient is all-reduced once for both branches, and each branch's partial sums are all-reduced
before the sum: one all-reduce per branch, as in a sequential block (summing the partial sums first
would save one, but needs an add that keeps partial sums).
"""

from __future__ import annotations

from nnscaler.config import ComputeConfig
from nnscaler.errors import PlanError
from nnscaler.graph.ir import Graph, Node, Shard
from nnscaler.graph.ops import BoundAnno, annotate_node, get_rule, layouts_for, split_layouts
from nnscaler.policies.blocks import blocks_hint, sub_dims
from nnscaler.policies.context_parallel import context_parallel_of, with_context_parallel
from nnscaler.policies.expert_parallel import MOE_EXPERTS_OP, check_ep_size, with_expert_parallel
from nnscaler.policies.flow import FlowTracer
from nnscaler.policies.options import TpOptions
from nnscaler.policies.plan import NodePlan, Plan
from nnscaler.policies.propagate import PropagationState, propagate
from nnscaler.policies.weighted import WeightedOp, derived_from, tensor_refs, weighted_op

__all__ = ["pas_tp"]


class _TpDecider:
    """The decisions `tp` makes during propagation (see the module docstring)."""

    def __init__(self, graph: Graph, ways: int):
        self.graph, self.ways = graph, ways
        self._bound: dict[str, BoundAnno | None] = {}
        self.tracer = FlowTracer(graph, ways, self.annotate)
        self.weight_views: dict[str, tuple[int, int]] = {}
        self.gathered: set[str] = set()
        """Outputs of column-parallel ops that are gathered before anything reads them."""

    def annotate(self, node: Node) -> BoundAnno | None:
        if node.name not in self._bound:
            self._bound[node.name] = annotate_node(node, self.graph)
        return self._bound[node.name]

    def __call__(self, state: PropagationState, node: Node, bound: BoundAnno) -> NodePlan | None:
        want = self.weight_views.get(node.name)
        if want is not None and bound.anno.outputs[0].dims:
            dim, blocks = want
            ident = bound.anno.outputs[0].dims[dim].ids[0]
            if not isinstance(split_layouts(bound, ident, self.ways, blocks), str):
                return NodePlan(ident, self.ways, blocks, note="weight view, split like its consumer")
        w = weighted_op(self.graph, node)
        if w is not None:
            return self._weighted(state, w, bound)
        if any(r.name in self.gathered for r in tensor_refs(self.graph, node)):
            return NodePlan()  # reads a gathered column-parallel output: whole
        if node.op == MOE_EXPERTS_OP:
            return self._experts(bound)
        if node.op == "aten.embedding.default":
            return self._embedding(node, bound)
        if node.op == "nnscaler.chunk_linear_cross_entropy.default":  # nnscaler.runtime.chunked_loss
            return self._chunked_loss(node, bound)
        rule = get_rule(node.op)
        if rule is not None and rule.family == "attention":
            return self._attention(state, node, bound)
        return None

    def _weighted(self, state: PropagationState, w: WeightedOp, bound: BoundAnno) -> NodePlan | None:
        if w.reads_row_parallel(state.layout(w.x)):
            if not isinstance(split_layouts(bound, w.k, self.ways), str):
                return NodePlan(w.k, self.ways, note="row-parallel")
        size = bound.sizes.get(w.n)
        if size is None or w.k not in bound.sizes:  # grouped convolutions: channels follow their input
            return None
        if size % self.ways:
            return NodePlan(
                note=f"kept whole: output features (size {size}) cannot be split {self.ways} ways"
            )
        tried: list[tuple[int, str]] = []  # (blocks, why the split does not flow cleanly)
        for blocks in self._column_blocks(w):
            lay = split_layouts(bound, w.n, self.ways, blocks)
            if isinstance(lay, str):
                continue
            flow = self.tracer.follow(state, w.node.outputs[0], lay.outputs[0])
            if flow.clean:
                return NodePlan(w.n, self.ways, blocks, note="column-parallel")
            tried.append((blocks, flow.reason))
        why = tried[0][1] if tried else f"output features (size {size}) cannot be split {self.ways} ways"
        # a conv (channel-first) is worth splitting even when a norm reads its output whole
        if tried and (w.channel_first or self.tracer.feeds_consumer(w.node.outputs[0])):
            # Megatron's gather_output: the weight is split, its output all-gathered at once and read
            # whole downstream (instead of cut through a head or reshuffled later)
            self.gathered.add(w.node.outputs[0])
            return NodePlan(w.n, self.ways, tried[0][0], note=f"column-parallel, output gathered: {why}")
        return NodePlan(
            note=f"kept whole: no tensor-parallel pattern matched: split on its output features, {why}"
        )

    def _column_blocks(self, w: WeightedOp) -> list[int]:
        """Block counts to try for a column split, most likely first: the chunks the output is cut
        into, then each sub-dim of its downstream reshape (the sub-dims before it are the blocks)."""
        if w.channel_first:
            return [1]
        out = w.node.outputs[0]
        found = [blocks_hint(self.graph, out)]
        before = 1
        for size in sub_dims(self.graph, out):
            if size % self.ways == 0:
                found.append(before)
            before *= size
        return list(dict.fromkeys(found))

    def _experts(self, bound: BoundAnno) -> NodePlan:
        """Mixture-of-experts experts (one op): every expert's intermediate features split, Megatron's
        column-parallel gate/up and row-parallel down for each expert (partial sums, one all-reduce)."""
        if isinstance(split_layouts(bound, "i", self.ways), str):
            return NodePlan(
                note=f"experts kept whole: intermediate size {bound.sizes.get('i')} not split {self.ways} ways"
            )
        return NodePlan(
            "i", self.ways, note="experts: intermediate features split (column gate/up, row down)"
        )

    def _embedding(self, node: Node, bound: BoundAnno) -> NodePlan | None:
        refs = tensor_refs(self.graph, node)
        if self.graph.values[refs[0].name].kind != "param":
            return None
        if not derived_from(self.graph, refs[1].name, "input"):  # token ids, not positions
            return NodePlan(note="indices are not token ids from the forward's inputs: kept whole")
        if not isinstance(split_layouts(bound, "v", self.ways), str):
            return NodePlan("v", self.ways, note="vocab-parallel")
        return NodePlan(note=f"vocabulary cannot be split {self.ways} ways: kept whole")

    def _chunked_loss(self, node: Node, bound: BoundAnno) -> NodePlan | None:
        """The LM head inside a chunked linear + cross-entropy: split its vocabulary (weight rows)."""
        if self.graph.values[tensor_refs(self.graph, node)[1].name].kind != "param":
            return None
        if not isinstance(split_layouts(bound, "v", self.ways), str):
            return NodePlan("v", self.ways, note="vocab-parallel chunked linear + cross-entropy")
        return NodePlan(note=f"vocabulary cannot be split {self.ways} ways: kept whole")

    def _attention(self, state: PropagationState, node: Node, bound: BoundAnno) -> NodePlan | None:
        """Split by query heads when every input arrives whole and the split flows to a row-parallel
        output projection (multi-query attention behind a fused projection whose output was gathered)."""
        if any(isinstance(lay, Shard) for lay in state.input_layouts(node)):
            return None
        out = bound.anno.outputs[0].dims
        if not out or len(out) < 3:
            return None
        heads = out[-3].ids[0]
        lay = layouts_for(bound, get_rule(node.op), heads, self.ways)
        if isinstance(lay, str) or not isinstance(lay.outputs[0], Shard):
            return None
        if self.tracer.follow(state, node.outputs[0], lay.outputs[0]).clean:
            return NodePlan(heads, self.ways, note="attention by query heads; inputs sliced locally")
        return None


def pas_tp(graph: Graph, cfg: ComputeConfig) -> Plan:
    """Megatron-style tensor parallelism over the plan devices (see the module docstring); with
    pas_config['cp_size'] > 1, over plan_ngpus // cp_size of them, the sequence over cp_size; with
    pas_config['ep_size'] > 1, over plan_ngpus // ep_size, the batch and the experts over ep_size."""
    opts = TpOptions.from_pas_config(cfg.pas_config, strict=False)
    cp = context_parallel_of(opts)
    if opts.ep_size > 1:
        check_ep_size(opts.ep_size, cfg.plan_ngpus, cp, "tp")
        return with_expert_parallel(graph, _pas_tp(graph, cfg.plan_ngpus // opts.ep_size), opts.ep_size)
    if cp is None:
        return _pas_tp(graph, cfg.plan_ngpus)
    if cfg.plan_ngpus % cp.size:
        raise PlanError(
            f"pas_config['cp_size']={cp.size} does not divide plan_ngpus ({cfg.plan_ngpus}): the plan devices "
            "form a cp_size x tensor-parallel mesh"
        )
    return with_context_parallel(graph, _pas_tp(graph, cfg.plan_ngpus // cp.size), cp)


def _pas_tp(graph: Graph, ways: int) -> Plan:
    if ways == 1:
        plans = propagate(graph, ways, None)
        return Plan("tp", ways, plans, ())
    decide = _TpDecider(graph, ways)
    plans = propagate(graph, ways, decide)
    # A weight reached through a view (experts' transposed weights, `x @ w.T`): split the view too, so
    # the parameter is stored sharded instead of whole and sliced on every step. Second pass.
    decide.weight_views.update(_weight_view_splits(graph, plans))
    if decide.weight_views:
        decide.gathered.clear()
        plans = propagate(graph, ways, decide)
    return Plan("tp", ways, plans, tuple(f"{name}: {p.note}" for name, p in plans.items() if p.note))


def _weight_view_splits(graph: Graph, plans: dict[str, NodePlan]) -> dict[str, tuple[int, int]]:
    """View nodes over a parameter whose consumer needs the view sharded: node name -> output dim."""
    out: dict[str, tuple[int, int]] = {}
    for node in graph.nodes:
        plan = plans[node.name]
        w = weighted_op(graph, node) if plan.split is not None else None
        if w is None:
            continue
        weight = graph.values[w.weight]
        if weight.kind == "param" or weight.producer is None:
            continue
        lay = layouts_for(annotate_node(node, graph), get_rule(node.op), plan.split, plan.ways, plan.blocks)
        if isinstance(lay, str):
            continue
        need = lay.inputs[w.weight_index]
        if isinstance(need, Shard) and plans[weight.producer].split is None:
            out[weight.producer] = (need.dim, need.blocks)
    return out
