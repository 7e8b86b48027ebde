"""View model of a pipelined rank: its stages as methods and its schedule as `_train_step`."""

from __future__ import annotations

import functools

from nnscaler.codegen.constants_code import constants_attrs, pipeline_constant_users
from nnscaler.codegen.expr import Formatter
from nnscaler.codegen.grad_groups_code import all_grad_groups, grad_group_lines
from nnscaler.codegen.inputs_code import unpack_inputs
from nnscaler.codegen.layer_functions import LayerFunction, LayerFunctions, StatementList
from nnscaler.codegen.pipeline_layout import PipelineLayout
from nnscaler.codegen.safe_text import docstring_text, literal
from nnscaler.codegen.schedule_code import pipeline_infer_lines, pipeline_train_lines
from nnscaler.codegen.sections import build_sections
from nnscaler.codegen.shape_code import folded_sizes, shape_code, sizes_read, uses_math
from nnscaler.codegen.shards_code import frozen_params, shard_lines
from nnscaler.codegen.view_model import (
    ModuleView,
    StageView,
    cp_subgroups,
    custom_op_imports,
    end2end_attrs,
    header_lines,
    inference_attrs,
    make_formatter,
    pipeline_out_spec,
    statement_trailing,
)
from nnscaler.config import ComputeConfig
from nnscaler.errors import CodegenError
from nnscaler.graph.ir import iter_refs
from nnscaler.mesh import mesh_axis_groups, rank_axis_groups
from nnscaler.partition import LocalTensor, PipelineProgram
from nnscaler.policies.pipeline_actions import stage_group

__all__ = ["PipelineLayout", "build_pipeline_view"]


def _stage_tensors(pprog: PipelineProgram, stages: list[int]) -> list[LocalTensor]:
    """The parameters and buffers of this rank's stages (once each; a weight two of them use must be
    stored alike)."""
    seen: dict[str, LocalTensor] = {}
    for s in stages:
        for t in pprog.stages[s].program.tensors:
            if t.name in seen and seen[t.name].layout != t.layout:
                raise CodegenError(
                    f"weight {t.original_name} is used by pipeline stages {pprog.param_stages[t.name]} with different "
                    f"layouts ({seen[t.name].layout} and {t.layout}); give its consumers the same split"
                )
            seen.setdefault(t.name, t)
    return list(seen.values())


def _tied_groups(pprog: PipelineProgram) -> dict[str, list[int]]:
    """Tensor -> device groups of the stages using it, where that is more than one group."""
    out = {}
    for name, stages in pprog.param_stages.items():
        pipe = pprog.pipeline
        groups = sorted({stage_group(pipe.scheduler, s, pipe.pp_size) for s in stages})
        if len(groups) > 1:
            layouts = {str(pprog.stages[s].program.layouts.get(name)) for s in stages}
            if len(layouts) > 1:
                # apply_pipeline stores a tied weight alike in every stage (partition.tied.shared_layouts),
                # so only a PipelineProgram built some other way gets here
                raise CodegenError(
                    f"weight {name} is stored in different layouts {sorted(layouts)} by pipeline stages {stages}: "
                    "the sum of their gradients would add different pieces of it. Store it in one layout in "
                    "every stage: build the stages with nnscaler.partition.apply_pipeline, or pass the same "
                    f"apply_plan(..., forced_layouts={{{name!r}: layout}}) to each stage (consumers that want "
                    "another layout get a converted copy). If apply_pipeline built these stages, this is a "
                    "bug: please report it, and meanwhile keep the weight replicated (Replicate()) in every stage"
                )
            out[name] = groups
    return out


def _spec(meta, fold: bool) -> str:
    return f"TensorSpec({shape_code(meta, fold)}, torch.{meta.dtype}, {meta.requires_grad})"


def _folded(pprog: PipelineProgram, fold: bool) -> frozenset[str]:
    """The size names every stage's code (statements, outputs, received buffers) was written with as
    constants: the same contract on every rank."""
    statements = [st for s in pprog.stages for st in s.program.statements]
    others = [m for s in pprog.stages for m in (s.program.outputs, *s.received_meta)]
    return folded_sizes(fold, statements, others, pprog.inputs.size_names)


def _pipeline_header(
    pprog: PipelineProgram, layout: PipelineLayout, rank: int, groups: dict, mine: list[int], meta: tuple
) -> list[str]:
    cfg, (model_name, policy, version) = layout.cfg, meta
    pipe = pprog.pipeline
    stage_ranks = {s: layout.stage_rank(rank, s) for s in range(pipe.nstages)}
    tail = [
        f"config: ComputeConfig(plan_ngpus={cfg.plan_ngpus}, runtime_ngpus={cfg.runtime_ngpus}, use_end2end=True)",
        f"pipeline: {pipe.nstages} stages on {pipe.pp_size} device groups, schedule {pipe.scheduler}, "
        f"{pipe.nmicros} micro-batches per train_step",
        f"this rank runs stage{'s' if len(mine) > 1 else ''} {', '.join(map(str, mine))}; "
        f"stage -> rank: {stage_ranks}",
        f"groups: tensor-parallel {groups['tp']}; pipeline {groups['pp']}; data-parallel {groups['dp']}",
    ]
    return header_lines(version, rank, cfg, model_name, policy, tail)


def _pipeline_init_call(
    pprog: PipelineProgram, layout: PipelineLayout, rank: int, tied: dict[str, list[int]], mesh: tuple
) -> tuple[str, dict]:
    cfg = layout.cfg
    all_groups = layout.all_groups(list(tied.values())) + [
        cfg.dims.dp_group(r) for r in range(cfg.plan_ngpus)
    ]
    groups = {"tp": layout.tp_group(rank), "dp": cfg.dims.dp_group(rank), "pp": layout.pp_group(rank)}
    if mesh:
        groups.update(rank_axis_groups(layout.tp_group(rank), mesh, rank))
        tp_groups = {tuple(layout.tp_group(r)) for r in range(cfg.runtime_ngpus)}
        all_groups += [
            g for tp in sorted(tp_groups) for axis in mesh_axis_groups(list(tp), mesh) for g in axis
        ]
    stage_groups = sorted({tuple(layout.tp_group(r)) for r in range(cfg.runtime_ngpus)})
    all_groups += cp_subgroups([st.program for st in pprog.stages], mesh, [list(g) for g in stage_groups])
    runs = lambda s: [r for r in range(cfg.runtime_ngpus) if layout.position(r)[1] == layout.group_of(s)]  # noqa: E731
    all_groups += all_grad_groups([(st.program, runs(st.index)) for st in pprog.stages], cfg, layout.tp_group)
    init_call = (
        f"super().__init__(rank={rank}, world_size={cfg.runtime_ngpus}, plan_ngpus={cfg.plan_ngpus}, "
        f"groups={groups}, all_groups={all_groups})"
    )
    return init_call, groups


def _pipeline_attrs(pprog: PipelineProgram, layout: PipelineLayout, rank: int) -> list[str]:
    pipe, cfg = pprog.pipeline, layout.cfg
    base, _, _ = layout.position(rank)
    last = layout.stage_rank(rank, pipe.nstages - 1)
    attrs = end2end_attrs(pprog.inputs.forward_args, pipe.nmicros, last, True)
    stage_groups = {
        s: [layout.rank(base, layout.group_of(s), i) for i in range(layout.tp)] for s in range(pipe.nstages)
    }
    return (
        attrs
        + inference_attrs(cfg)
        + constants_attrs(pipeline_constant_users(pprog, stage_groups.__getitem__))
    )


def _stage_views(
    pprog: PipelineProgram, mine: list[int], fmt: Formatter, full_shapes: dict, enabled: bool
) -> tuple[list[StageView], list[LayerFunction], bool]:
    """The stage methods of this rank (repeated layers of all of them folded into shared functions)."""
    layers = LayerFunctions(fmt, enabled)
    bodies = []
    for index in mine:
        program = pprog.stages[index].program
        trailing = functools.partial(statement_trailing, program=program, full_shapes=full_shapes)
        keep = [r.name for r in iter_refs(program.outputs)]
        bodies.append(
            StatementList(program.statements, keep, trailing, program.recompute, program.module_classes)
        )
    folded = layers.fold(bodies)
    built = [_stage_view(pprog, s, fmt, body, stmts) for s, body, stmts in zip(mine, bodies, folded)]
    uses_checkpoint = any(uses for _, uses in built) or any(f.uses_checkpoint for f in layers.functions)
    return [view for view, _ in built], layers.functions, uses_checkpoint


def build_pipeline_view(
    pprog: PipelineProgram,
    rank: int,
    cfg: ComputeConfig,
    model_name: str,
    policy: str,
    full_shapes: dict[str, tuple],
    version: str,
    layer_functions: bool = True,
) -> ModuleView:
    """Everything the template needs to write a pipelined gencode{rank}.py."""
    pipe = pprog.pipeline
    layout = PipelineLayout(cfg, pipe.pp_size, pipe.scheduler)
    base, group, tp_index = layout.position(rank)
    mine = [s.index for s in pprog.stages if layout.group_of(s.index) == group]
    tensors = _stage_tensors(pprog, mine)
    param_names = {t.name for t in tensors}
    mesh = pprog.stages[0].program.mesh if pprog.stages else ()
    fold = pprog.inputs.static_shapes  # constant_folding=True: sizes written as traced
    fmt = make_formatter(cfg, rank, tp_index, param_names, mesh, fold)
    frozen = frozen_params([s.program for s in pprog.stages])
    shards, aliases = shard_lines(tensors, tp_index, pprog.tp_size, mesh, frozen)
    tied = _tied_groups(pprog)
    tied_lines = [
        f"self.add_tied({literal(name)}, {[layout.rank(base, g, tp_index) for g in groups]})"
        f"  # used by stages {pprog.param_stages[name]}: gradients summed across them"
        for name, groups in tied.items()
        if name in param_names
    ]
    stages, functions, uses_checkpoint = _stage_views(pprog, mine, fmt, full_shapes, layer_functions)
    init_call, groups = _pipeline_init_call(pprog, layout, rank, tied, mesh)
    rules = pprog.inputs.shape_rules + [r for s in pprog.stages for r in s.program.shape_rules]
    unpack, in_spec_json = unpack_inputs(pprog.inputs, rules, _folded(pprog, fold))
    defaults = [f"{k}={v!r}" for k, v in pprog.inputs.untraced_args.items()]
    statements = [st for s in mine for st in pprog.stages[s].program.statements]
    args = (
        pipe.scheduler,
        pipe.nstages,
        pipe.pp_size,
        pipe.nmicros,
        group,
        functools.partial(layout.stage_rank, rank),
    )
    out_spec, spec_imports = pipeline_out_spec(pprog.inputs.out_spec)
    view = ModuleView(
        _pipeline_header(pprog, layout, rank, groups, mine, (model_name, policy, version)),
        spec_imports + custom_op_imports(statements),
        rank,
        init_call,
        shards,
        aliases,
        ", ".join(["self"] + pprog.inputs.forward_args + defaults),
        [],
        "",
        out_spec,
        fmt.used_sync_norm,
        any(st.op.startswith("rng.") or st.shard_rng for st in statements),
        unpack,
        in_spec_json,
        uses_checkpoint,
        class_attrs=_pipeline_attrs(pprog, layout, rank),
        tied=tied_lines,
        grad_groups=grad_group_lines([pprog.stages[s].program for s in mine], cfg, layout.tp_group, rank),
        stages=stages,
        train_step=pipeline_train_lines(*args),
        infer_step=pipeline_infer_lines(*args),
        schedule_doc=(
            f"{pipe.scheduler} schedule: {pipe.nstages} stages x {pipe.nmicros} micro-batches. This rank runs "
            f"stage{'s' if len(mine) > 1 else ''} {', '.join(map(str, mine))}."
        ),
        layer_functions=functions,
    )
    _add_stage_inputs(view, pprog, statements, mesh)
    return view


def _add_stage_inputs(view: ModuleView, pprog: PipelineProgram, statements: list, mesh: tuple) -> None:
    """What micro_batch_inputs returns and what stage_inputs says each stage receives."""
    view.input_names = sorted({n for s in pprog.stages for n in s.graph_inputs})
    view.input_names += sorted(pprog.inputs.size_names)
    specs = {s.index: [_spec(m, pprog.inputs.static_shapes) for m in s.received_meta] for s in pprog.stages}
    spec_sizes = sizes_read([m for codes in specs.values() for m in codes], pprog.inputs.size_names)
    view.stage_specs = specs
    view.mesh_groups = [f"tp_axis{k}" for k in range(len(mesh))]
    view.stage_spec_sizes = [f'{n} = mb["{n}"]' for n in spec_sizes]
    view.uses_math = uses_math([(st.args, st.kwargs) for st in statements]) or any(
        "math." in c for codes in specs.values() for c in codes
    )


def _stage_view(
    pprog: PipelineProgram, index: int, fmt: Formatter, body: StatementList, statements: list
) -> tuple[StageView, bool]:
    stage = pprog.stages[index]
    program = stage.program
    sections, uses_checkpoint = build_sections(program, fmt, body.trailing, statements)
    outs = [fmt(r) for r in program.outputs] if program.outputs else []
    return_code = "(" + ", ".join(outs) + ("," if len(outs) == 1 else "") + ")"
    params = "".join(f", {n}" for n in stage.received)
    first, last = stage.modules
    role = (
        "the loss is its first output"
        if index == len(pprog.stages) - 1
        else f"outputs go to stage {index + 1}"
    )
    doc = docstring_text(
        f"Stage {index} of {len(pprog.stages)}: {first or 'start'} .. {last or 'end'}; {role}."
    )
    sizes = (
        []
        if fmt.fold_sizes
        else sizes_read([(st.args, st.kwargs) for st in program.statements], pprog.inputs.size_names)
    )
    reads = [f'{n} = mb["{n}"]' for n in [*stage.graph_inputs, *sizes]]
    return StageView(index, params, doc, reads, sections, return_code), uses_checkpoint
