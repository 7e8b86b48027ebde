"""Pipeline partition: one SPMD program per stage, with the activations each stage receives and sends."""

from __future__ import annotations

from dataclasses import dataclass, field

from nnscaler.errors import PartitionError
from nnscaler.graph.ir import Graph, TensorMeta, cut_graph
from nnscaler.partition.apply_plan import apply_plan
from nnscaler.partition.program import Program
from nnscaler.partition.tied import shared_layouts
from nnscaler.policies.plan import PipelinePlan, Plan

__all__ = ["StageProgram", "PipelineProgram", "apply_pipeline"]


@dataclass
class StageProgram:
    """What the devices of one stage run for one micro-batch.

    received: activations from the previous stage (full tensors, in this order); graph_inputs: the
    forward inputs it reads from the micro-batch; program.outputs: what it sends to the next stage
    (the last stage: the forward's flat outputs, loss first).
    """

    index: int
    program: Program
    received: list[str]
    graph_inputs: list[str]
    received_meta: list[TensorMeta]
    sent_meta: list[TensorMeta | None]
    modules: tuple[str, str] = ("", "")
    """Module paths of its first and last op (for comments)."""


@dataclass
class PipelineProgram:
    pipeline: PipelinePlan
    tp_size: int
    stages: list[StageProgram]
    inputs: Program
    """Forward-signature information of the whole graph (how a micro-batch is unpacked); no statements."""
    param_stages: dict[str, list[int]] = field(default_factory=dict)
    """Parameter / buffer name -> the stages that use it (more than one: tied across stages)."""


def _shell(graph: Graph) -> Program:
    return Program(
        ways=1,
        forward_args=list(graph.forward_args),
        input_leaves=list(graph.input_leaves),
        in_spec=graph.in_spec,
        input_constants=dict(graph.input_constants),
        untraced_args=dict(graph.untraced_args),
        out_spec=graph.out_spec,
        input_meta={n: graph.values[n].meta for n in graph.inputs},
        size_names=dict(graph.size_names),
        shape_rules=list(graph.shape_rules),
        static_shapes=graph.static_shapes,
        constant_names=sorted(graph.constants),
    )


def apply_pipeline(graph: Graph, plan: Plan, *, fold_weight_grads: bool = False) -> PipelineProgram:
    """Cut the graph at the plan's stage starts and partition each stage over its tp_size devices.
    `fold_weight_grads`: see apply_plan; never for a weight several stages hold (tied: its gradient is
    summed over the stages, each stage's share already summed over its own axes)."""
    pipe = plan.pipeline
    if pipe is None:
        raise PartitionError("apply_pipeline needs a plan with pipeline stages")
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    pieces = cut_graph(graph, [index[s] for s in pipe.starts])
    stage_plans = [
        Plan(
            plan.policy,
            plan.tp_size,
            {n.name: plan.node(n.name) for n in piece.graph.nodes if n.name in plan.nodes},
            recompute=plan.recompute,
            mesh=plan.mesh,
        )
        for piece in pieces
    ]
    holders: dict[str, int] = {}
    for piece in pieces:
        for name in piece.params:
            holders[name] = holders.get(name, 0) + 1
    fold = {"fold_weight_grads": fold_weight_grads, "keep": frozenset(n for n, k in holders.items() if k > 1)}
    programs = [apply_plan(piece.graph, p, **fold) for piece, p in zip(pieces, stage_plans)]
    stored = shared_layouts([p.tensors for p in programs])
    for i, (piece, program) in enumerate(zip(pieces, programs)):
        forced = {t.name: stored[t.name] for t in program.tensors if t.name in stored}
        if any(program.layouts[name] != layout for name, layout in forced.items()):
            programs[i] = apply_plan(piece.graph, stage_plans[i], forced, **fold)
    stages = []
    param_stages: dict[str, list[int]] = {}
    for piece, program in zip(pieces, programs):
        for name in piece.received:
            if graph.values[name].meta is None:
                raise PartitionError(
                    f"stage {piece.index} would receive {name!r}, which is not a tensor; pipeline stages can only "
                    "pass tensors (move the stage start, pas_config['pipeline_stages'])"
                )
        for name in piece.params:
            param_stages.setdefault(name, []).append(piece.index)
        sent_meta = [graph.values[r.name].meta if hasattr(r, "name") else None for r in piece.sent]
        paths = [n.module_path for n in piece.graph.nodes if n.module_path]
        stages.append(
            StageProgram(
                piece.index,
                program,
                list(piece.received),
                list(piece.graph_inputs),
                [graph.values[n].meta for n in piece.received],
                sent_meta,
                (paths[0], paths[-1]) if paths else ("", ""),
            )
        )
    return PipelineProgram(pipe, plan.tp_size, stages, _shell(graph), param_stages)
