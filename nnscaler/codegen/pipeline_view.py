"""View model of a pipelined rank: its stages as methods and its schedule as `_train_step`."""

from __future__ import annotations

from nnscaler.codegen.constants_code import constants_attrs, pipeline_constant_users
from nnscaler.codegen.expr import Formatter
from nnscaler.codegen.safe_text import comment_text, docstring_text, literal
from nnscaler.codegen.schedule_code import pipeline_infer_lines, pipeline_train_lines
from nnscaler.codegen.sections import build_sections
from nnscaler.codegen.shape_code import shape_code, sizes_read, uses_math
from nnscaler.codegen.view_model import (
    CodeLine,
    ModuleView,
    Section,
    StageView,
    _trailing,
    _unpack_inputs,
    custom_op_imports,
    end2end_attrs,
    frozen_params,
    inference_attrs,
    shard_lines,
)
from nnscaler.config import ComputeConfig
from nnscaler.errors import CodegenError
from nnscaler.mesh import mesh_axis_groups, rank_axis_groups
from nnscaler.partition import LocalTensor, PipelineProgram

__all__ = ["PipelineLayout", "build_pipeline_view"]


class PipelineLayout:
    """Which global rank runs which stage: stage s on device group s % pp_size of each replica."""

    def __init__(self, cfg: ComputeConfig, pp_size: int):
        self.cfg, self.pp_size, self.tp = cfg, pp_size, cfg.plan_ngpus // pp_size

    def position(self, rank: int) -> tuple[int, int, int]:
        """(replica base rank, device group, index inside the group's tensor parallelism)."""
        device = rank % self.cfg.plan_ngpus
        return rank - device, device // self.tp, device % self.tp

    def rank(self, base: int, group: int, tp_index: int) -> int:
        return base + group * self.tp + tp_index

    def stage_rank(self, rank: int, stage: int) -> int:
        """The rank running `stage` that exchanges activations with `rank` (same replica and tp index)."""
        base, _, i = self.position(rank)
        return self.rank(base, stage % self.pp_size, i)

    def tp_group(self, rank: int) -> list[int]:
        base, g, _ = self.position(rank)
        return [self.rank(base, g, i) for i in range(self.tp)]

    def pp_group(self, rank: int) -> list[int]:
        base, _, i = self.position(rank)
        return [self.rank(base, g, i) for g in range(self.pp_size)]

    def all_groups(self, tied_devices: list[list[int]]) -> list[list[int]]:
        """Every tp, pp and tied-weight group of every replica (each rank creates all, in this order)."""
        out: list[list[int]] = []
        for rank in range(self.cfg.runtime_ngpus):
            for grp in (self.tp_group(rank), self.pp_group(rank)):
                if grp not in out:
                    out.append(grp)
        for groups in tied_devices:
            for base in range(0, self.cfg.runtime_ngpus, self.cfg.plan_ngpus):
                for i in range(self.tp):
                    grp = [self.rank(base, g, i) for g in groups]
                    if grp not in out:
                        out.append(grp)
        return out


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
        groups = sorted({s % pprog.pipeline.pp_size for s in stages})
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


def _spec(meta) -> str:
    return f"TensorSpec({shape_code(meta)}, torch.{meta.dtype}, {meta.requires_grad})"


def build_pipeline_view(
    pprog: PipelineProgram,
    rank: int,
    cfg: ComputeConfig,
    model_name: str,
    policy: str,
    full_shapes: dict[str, tuple],
    version: str,
) -> ModuleView:
    """Everything the template needs to write a pipelined gencode{rank}.py."""
    pipe = pprog.pipeline
    layout = PipelineLayout(cfg, pipe.pp_size)
    base, group, tp_index = layout.position(rank)
    mine = [s.index for s in pprog.stages if s.index % pipe.pp_size == group]
    ways = pprog.tp_size
    tensors = _stage_tensors(pprog, mine)
    param_names = {t.name for t in tensors}
    mesh = pprog.stages[0].program.mesh if pprog.stages else ()
    fmt = Formatter(
        tp_index,
        param_names,
        sync_batch_norm=cfg.runtime_ngpus > cfg.plan_ngpus,
        rank=rank,
        plan_ngpus=cfg.plan_ngpus,
        runtime_ngpus=cfg.runtime_ngpus,
        mesh=mesh,
    )
    frozen = frozen_params([s.program for s in pprog.stages])
    shards, aliases = shard_lines(tensors, tp_index, ways, mesh, frozen)
    tied = _tied_groups(pprog)
    tied_lines = [
        f"self.add_tied({literal(name)}, {[layout.rank(base, g, tp_index) for g in groups]})"
        f"  # used by stages {pprog.param_stages[name]}: gradients summed across them"
        for name, groups in tied.items()
        if name in param_names
    ]
    built = [_stage_view(pprog, s, fmt, full_shapes) for s in mine]
    stages = [view for view, _ in built]
    dp_group = cfg.dims.dp_group(rank)
    all_groups = layout.all_groups(list(tied.values())) + [
        cfg.dims.dp_group(r) for r in range(cfg.plan_ngpus)
    ]
    groups = {"tp": layout.tp_group(rank), "dp": dp_group, "pp": layout.pp_group(rank)}
    if mesh:
        groups.update(rank_axis_groups(layout.tp_group(rank), mesh, rank))
        tp_groups = {tuple(layout.tp_group(r)) for r in range(cfg.runtime_ngpus)}
        all_groups += [
            g for tp in sorted(tp_groups) for axis in mesh_axis_groups(list(tp), mesh) for g in axis
        ]
    init_call = (
        f"super().__init__(rank={rank}, world_size={cfg.runtime_ngpus}, plan_ngpus={cfg.plan_ngpus}, "
        f"groups={groups}, all_groups={all_groups})"
    )
    stage_ranks = {s: layout.stage_rank(rank, s) for s in range(pipe.nstages)}
    header = [
        f"Generated by nnscaler {version} for rank {rank} of {cfg.runtime_ngpus}. Regenerated per `reuse` when",
        "the model, the dummy inputs, the policy or the ComputeConfig change.",
        f"model:  {model_name}",
        f"policy: {policy}    plan: plan.json",
        f"config: ComputeConfig(plan_ngpus={cfg.plan_ngpus}, runtime_ngpus={cfg.runtime_ngpus}, use_end2end=True)",
        f"pipeline: {pipe.nstages} stages on {pipe.pp_size} device groups, schedule {pipe.scheduler}, "
        f"{pipe.nmicros} micro-batches per train_step",
        f"this rank runs stage{'s' if len(mine) > 1 else ''} {', '.join(map(str, mine))}; "
        f"stage -> rank: {stage_ranks}",
        f"groups: tensor-parallel {groups['tp']}; pipeline {groups['pp']}; data-parallel {dp_group}",
    ]
    header = [comment_text(line) for line in header]  # names from the user's model: one line each
    class_attrs = end2end_attrs(pprog.inputs.forward_args, pipe.nmicros, stage_ranks[pipe.nstages - 1], True)
    stage_groups = {
        s: [layout.rank(base, s % pipe.pp_size, i) for i in range(layout.tp)] for s in range(pipe.nstages)
    }
    class_attrs += inference_attrs(cfg) + constants_attrs(
        pipeline_constant_users(pprog, stage_groups.__getitem__)
    )
    rules = pprog.inputs.shape_rules + [r for s in pprog.stages for r in s.program.shape_rules]
    unpack, in_spec_json = _unpack_inputs(pprog.inputs, rules)
    input_names = sorted({n for s in pprog.stages for n in s.graph_inputs})
    input_names += sorted(pprog.inputs.size_names)
    defaults = [f"{k}={v!r}" for k, v in pprog.inputs.untraced_args.items()]
    signature = ", ".join(["self"] + pprog.inputs.forward_args + defaults)
    statements = [st for s in mine for st in pprog.stages[s].program.statements]
    specs = {s.index: [_spec(m) for m in s.received_meta] for s in pprog.stages}
    spec_sizes = sizes_read([m for codes in specs.values() for m in codes], pprog.inputs.size_names)
    imports = custom_op_imports(statements)
    rank_of = stage_ranks.__getitem__
    args = (pipe.scheduler, pipe.nstages, pipe.pp_size, pipe.nmicros, group, rank_of)
    view = ModuleView(
        header,
        imports,
        rank,
        init_call,
        shards,
        aliases,
        signature,
        [],
        "",
        None,
        fmt.used_sync_norm,
        any(st.op.startswith("rng.") or st.shard_rng for st in statements),
        unpack,
        in_spec_json,
        any(uses for _, uses in built),
        class_attrs=class_attrs,
        tied=tied_lines,
        stages=stages,
        input_names=input_names,
        train_step=pipeline_train_lines(*args),
        infer_step=pipeline_infer_lines(*args),
        schedule_doc=(
            f"{pipe.scheduler} schedule: {pipe.nstages} stages x {pipe.nmicros} micro-batches. This rank runs "
            f"stage{'s' if len(mine) > 1 else ''} {', '.join(map(str, mine))}."
        ),
    )
    view.stage_specs = specs
    view.mesh_groups = [f"tp_axis{k}" for k in range(len(mesh))]
    view.stage_spec_sizes = [f'{n} = mb["{n}"]' for n in spec_sizes]
    view.uses_math = uses_math([(st.args, st.kwargs) for st in statements]) or any(
        "math." in c for codes in specs.values() for c in codes
    )
    return view


def _stage_view(
    pprog: PipelineProgram, index: int, fmt: Formatter, full_shapes: dict[str, tuple]
) -> tuple[StageView, bool]:
    stage = pprog.stages[index]
    program = stage.program
    sections, uses_checkpoint = build_sections(
        program, fmt, lambda s: _trailing(s, program, full_shapes), CodeLine, Section
    )
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
    sizes = sizes_read([(st.args, st.kwargs) for st in program.statements], pprog.inputs.size_names)
    reads = [f'{n} = mb["{n}"]' for n in [*stage.graph_inputs, *sizes]]
    return StageView(index, params, doc, reads, sections, return_code), uses_checkpoint
