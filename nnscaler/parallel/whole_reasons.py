"""Why an op runs whole, or a weight is held whole, on every device of its stage: one `Why` per cause,
phrased so that ops and weights with the same cause group together (see nnscaler.parallel.replicated).

The cause of an op is, in order: a pipeline-only plan (one device per stage), an opaque region (a leaf
module or a custom autograd Function), an op without an annotation, the policy's own note (a size that
does not divide, no pattern matched), an annotation with no dim that divides, the planner's choice
(autodist: too small to pay its communication, or cheaper overall in its search), or none of these: it
reads only whole tensors (norms, residual adds between split regions). An op of the last kind downstream
of an op kept whole for a named cause takes that cause. A weight's cause is its first reader's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from nnscaler.graph.ir import Graph, Node
from nnscaler.graph.ops import annotate_node, get_rule, is_bias_split, split_candidates, split_layouts
from nnscaler.graph.ops.custom import is_autograd_op
from nnscaler.graph.ops.leaf import is_leaf_op
from nnscaler.policies.autodist.cost import node_flops
from nnscaler.policies.plan import Plan

__all__ = ["Why", "NAMED_KINDS", "node_causes", "param_cause", "op_flops"]

NAMED_KINDS = (
    "pipeline-only",
    "opaque",
    "unannotated",
    "indivisible",
    "policy",
    "planner-small",
    "planner-cheaper",
    "data-parallel",
    "sliced",
    "bias",
    "unused",
)
"""Kinds of cause that say why; 'follows' (reads only whole tensors) does not on its own."""


@dataclass(frozen=True)
class Why:
    """One cause: its kind and the sentence that names it (the key ops and weights group by)."""

    kind: str
    text: str
    saved_s: float = field(default=0.0, compare=False)
    """planner-*: compute seconds per micro-batch splitting it would save (forward + backward)."""
    comm_s: float = field(default=0.0, compare=False)
    """planner-*: seconds to gather its outputs whole again (forward + backward)."""

    @property
    def named(self) -> bool:
        return self.kind in NAMED_KINDS


PIPELINE_ONLY = Why(
    "pipeline-only",
    "pipeline-only plan: each stage runs on one device, so a stage's ops and weights are all held whole there",
)
FOLLOWS = Why(
    "follows",
    "reads only whole tensors and no policy rule splits it (norms, residual adds, losses between split regions)",
)


_SIZE = re.compile(r"(cannot be split|not split) \d+ ways|do not divide|does not divide")
"""A policy's note that says a size does not divide the devices."""
_WHERE = re.compile(r" at \S+:\d+(?: \([^()]*\))?")
"""' at file.py:12 (module.path)' in a policy's note: left out, so that the same cause groups together."""


def _line(node: Node) -> str:
    return node.source.split("  ", 1)[0] if node.source else "unknown source"


def op_flops(node: Node, graph: Graph) -> float:
    """Forward FLOPs of one op (autodist's analytic count; views 0). An opaque op's count is estimated as
    2 x its parameters x its rows (a linear layer's), at least its output size."""
    from nnscaler.policies.autodist.cost import is_free_op

    if is_free_op(node, graph):
        return 0.0
    try:
        flops = float(node_flops(node, graph))
    except TypeError:  # a symbolic size
        return 0.0
    if is_leaf_op(node.op) or is_autograd_op(node.op):
        metas = [graph.values[n] for n in node.input_names()]
        params = sum(v.meta.numel for v in metas if v.kind == "param" and v.meta is not None)
        acts = [v.meta for v in metas if v.kind != "param" and v.meta is not None and v.meta.shape]
        rows = acts[0].numel // max(acts[0].shape[-1], 1) if acts else 1
        flops = max(flops, 2.0 * params * rows)
    return flops


def _own_cause(graph: Graph, plan: Plan, node: Node, ways: int) -> Why | None:
    """The cause of a whole op from the op itself (None: it only follows whole inputs)."""
    if is_leaf_op(node.op):
        path = node.kwargs.get("leaf", node.module_path)
        why = node.kwargs.get("why") or "listed as a leaf module"
        return Why("opaque", f"opaque region {path} ({node.module_class or 'leaf module'}) runs whole: {why}")
    if is_autograd_op(node.op):
        return Why(
            "opaque",
            f"opaque autograd Function {node.op} at {_line(node)} has no annotation: it runs whole "
            "(nnscaler.register_op gives it one)",
        )
    bound = annotate_node(node, graph)
    if get_rule(node.op) is None or bound is None:
        return Why("unannotated", f"op {node.op} at {_line(node)} has no annotation: it runs whole")
    note = plan.node(node.name).note
    if note:
        kind = "indivisible" if _SIZE.search(note) else "policy"
        return Why(kind, f"{plan.policy}: {_WHERE.sub('', note)} ({node.op})")
    if not split_candidates(bound, ways):
        return _unsplittable(bound, node, ways)
    return None  # it follows its inputs, or (autodist) the search chose it: see node_causes


def _unsplittable(bound, node: Node, ways: int) -> Why:
    """No identifier of the annotation splits `ways` ways: sizes that do not divide, or none allowed."""
    idents = [i for i in bound.anno.identifiers() if not i.isdigit() and i in bound.sizes]
    whys = {i: split_layouts(bound, i, ways) for i in idents}
    sizes = [f"{i}={bound.sizes[i]}" for i, w in whys.items() if isinstance(w, str) and "do not divide" in w]
    if sizes:
        return Why(
            "indivisible", f"{node.op}: its splittable sizes ({', '.join(sizes)}) do not divide {ways} ways"
        )
    return Why(
        "indivisible", f"{node.op}: its annotation allows no split (e.g. a tensor it creates, a '^' dim)"
    )


def node_causes(
    graph: Graph, plan: Plan, tp_of: dict[str, int], cfg=None, inherited: set[str] | None = None
) -> dict[str, Why]:
    """Node name -> the cause it runs whole, for every node the plan keeps whole on its stage's devices.

    `tp_of`: node name -> devices of its stage; `cfg` (a ComputeConfig) lets autodist's choices be costed;
    `inherited` (filled in when given): the nodes whose cause is an op they read, not their own.
    """
    out: dict[str, Why] = {}
    planner: list[Node] = []
    for node in graph.nodes:
        ways = tp_of[node.name]
        if ways <= 1:
            out[node.name] = PIPELINE_ONLY
            continue
        if plan.node(node.name).is_split:
            continue
        why = _own_cause(graph, plan, node, ways)
        if why is None and plan.policy == "autodist":
            planner.append(node)
            continue
        if why is None and inherited is not None:
            inherited.add(node.name)
        out[node.name] = why or _inherited(graph, plan, node, out)
    out.update(_planner_causes(graph, planner, tp_of, cfg))
    return out


def _inherited(graph: Graph, plan: Plan, node: Node, causes: dict[str, Why]) -> Why:
    """A following op takes the named cause of a whole op it reads (the first such input), or names the
    gathered output of a column-parallel op it reads; else FOLLOWS."""
    for name in node.input_names():
        producer = graph.values[name].producer
        why = causes.get(producer) if producer else None
        if why is not None and why.kind in ("opaque", "unannotated", "indivisible"):
            return why
        note = plan.node(producer).note if producer else ""
        if note.startswith("column-parallel, output gathered"):
            return Why(
                "policy", f"{plan.policy}: reads the output of a column-parallel op gathered whole ({note})"
            )
    return FOLLOWS


def _planner_causes(graph: Graph, nodes: list[Node], tp_of: dict[str, int], cfg) -> dict[str, Why]:
    """autodist kept these whole although they could split: too small to pay for regathering their
    outputs (the compute splitting saves is less than that communication), or cheaper in its search."""
    if not nodes:
        return {}
    from nnscaler.policies.autodist.comm import all_gather
    from nnscaler.policies.autodist.cost import CostContext, compute_time
    from nnscaler.policies.autodist.policy import default_cluster, planner_setup

    cluster = planner_setup(graph, cfg).cluster if cfg is not None else default_cluster()
    out = {}
    for node in nodes:
        ways = tp_of[node.name]
        ctx = CostContext(cluster, ways=ways)
        metas = [graph.values[n].meta for n in (*node.input_names(), *node.outputs)]
        metas = [m for m in metas if m is not None]
        nbytes = sum(m.numel * ctx.elem_bytes(m.dtype) for m in metas)
        flops = op_flops(node, graph)
        dtype = metas[0].dtype if metas else "float32"
        matmul = node.op.startswith(("aten.linear", "aten.mm", "aten.bmm", "aten.matmul", "aten.addmm"))
        saved = compute_time(flops, nbytes, ctx, dtype, matmul) - compute_time(
            flops / ways, nbytes / ways, ctx, dtype, matmul
        )
        out_bytes = sum(
            m.numel * ctx.elem_bytes(m.dtype) for o in node.outputs if (m := graph.values[o].meta) is not None
        )
        comm = 2 * all_gather(out_bytes, ways, ctx.tp_link)  # forward all-gather, backward its mirror
        kind, text = (
            ("planner-small", "autodist chose to replicate: too small to pay its communication")
            if saved < comm
            else ("planner-cheaper", "autodist chose to replicate: cheaper overall in its search")
        )
        out[node.name] = Why(kind, text, saved, comm)
    return out


def param_cause(
    graph: Graph, plan: Plan, consumers: dict[str, list[Node]], name: str, causes: dict[str, Why]
) -> Why:
    """Why parameter `name` is held whole: its first reader's cause (through views of it)."""
    readers = consumers.get(name, [])
    if not readers:
        return Why("unused", "no op reads it")
    node, view = readers[0], None
    while (
        not plan.node(node.name).is_split and len(node.input_names()) == 1 and consumers.get(node.outputs[0])
    ):
        view = view or node
        node = consumers[node.outputs[0]][0]
    np = plan.node(node.name)
    if not np.is_split:
        return causes.get(node.name, FOLLOWS)
    if view is not None:
        return Why(
            "sliced",
            f"read through {view.op}, which cannot be split: stored whole, each device slices the part it needs",
        )
    bound = annotate_node(node, graph)
    if bound is not None and is_bias_split(bound, get_rule(node.op), np.split, np.ways):
        return Why("bias", "bias of a row-parallel op: added once, after the all-reduce")
    return Why(
        "data-parallel",
        "its readers split only dims a weight does not have (batch, sequence): held whole, as in data parallelism",
    )
