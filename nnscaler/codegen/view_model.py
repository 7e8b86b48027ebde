"""View models: every decision about a generated file, as plain data the template only loops over."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from nnscaler.codegen.constants_code import constants_attrs, spmd_constant_users
from nnscaler.codegen.expr import Formatter
from nnscaler.codegen.safe_text import comment_text, literal
from nnscaler.codegen.schedule_code import plain_infer_lines, plain_train_lines
from nnscaler.codegen.sections import build_sections
from nnscaler.codegen.shape_code import rule_check_lines, size_check_lines, uses_math
from nnscaler.config import ComputeConfig
from nnscaler.graph.ir import MeshLayout, Replicate, Shard, iter_refs, storage_shard
from nnscaler.graph.ops import op_module
from nnscaler.mesh import mesh_axis_groups, rank_axis_groups
from nnscaler.partition import LocalTensor, Program, Statement

__all__ = [
    "ShardLine",
    "CodeLine",
    "Section",
    "StageView",
    "ModuleView",
    "build_module_view",
    "end2end_attrs",
]


@dataclass
class ShardLine:
    code: str
    comment: str


@dataclass
class CodeLine:
    comments: list[str]
    code: str
    trailing: str = ""
    no_grad: bool = False
    context: str = ""
    """A `with` block around the line (torch.no_grad(), the shard generator)."""
    indent: int = 0
    """Extra indentation levels (inside a recompute function)."""


@dataclass
class Section:
    title: str
    lines: list[CodeLine] = field(default_factory=list)
    key: str = ""


@dataclass
class StageView:
    """One pipeline stage's method: `stage{index}(self, mb, *received)` (mb: the micro-batch dict)."""

    index: int
    params: str
    doc: str
    reads: list[str]
    """Lines taking the stage's traced inputs out of the micro-batch dict x."""
    sections: list[Section]
    return_code: str


@dataclass
class ModuleView:
    header: list[str]
    imports: list[str]
    rank: int
    init_call: str
    shards: list[ShardLine]
    aliases: list[str]
    forward_signature: str
    sections: list[Section]
    return_code: str
    out_spec_json: str | None
    uses_sync_norm: bool = False
    uses_rng: bool = False
    unpack_inputs: list[str] = field(default_factory=list)
    """Lines that take tensors out of nested or non-tensor forward arguments."""
    in_spec_json: str | None = None
    uses_checkpoint: bool = False
    uses_math: bool = False
    """Run-time size expressions call math (ceil, floor)."""
    class_attrs: list[str] = field(default_factory=list)
    """Extra class attribute lines (end-to-end mode and pipelines)."""
    tied: list[str] = field(default_factory=list)
    """`add_tied` lines: weights whose gradients are summed across pipeline stages."""
    stages: list[StageView] = field(default_factory=list)
    """Pipeline stage methods (then `forward` only explains how to call the module)."""
    input_names: list[str] = field(default_factory=list)
    """Pipelines: the traced input values (and input sizes) `micro_batch_inputs` returns."""
    mesh_groups: list[str] = field(default_factory=list)
    """2-D splits: the mesh-axis groups (`tp_axis0`, ...) forward uses besides `tp`."""
    stage_specs: dict[int, list[str]] = field(default_factory=dict)
    """Pipelines: stage -> TensorSpec code of each activation it receives."""
    stage_spec_sizes: list[str] = field(default_factory=list)
    """Pipelines: lines reading the input sizes those TensorSpecs use from the micro-batch dict mb."""
    train_step: list[str] = field(default_factory=list)
    """End-to-end mode: the body of `_train_step` (empty: no end-to-end functions)."""
    infer_step: list[str] = field(default_factory=list)
    schedule_doc: str = ""


def _shard_arg(layout, tp_index: int, ways: int, mesh: tuple[int, ...] = ()) -> str:
    shard = storage_shard(layout, tp_index, mesh or (ways,))
    return f", shard={shard}" if shard is not None else ""


def _shard_comment(t, layout, ways: int) -> str:
    if isinstance(layout, MeshLayout):
        return f"mesh layout {layout}"
    if isinstance(layout, Shard) and ways > 1:
        what = "rows" if layout.dim == 0 else f"dim {layout.dim}"
        blocks = f" of each of {layout.blocks} blocks" if layout.blocks > 1 else ""
        return f"{what}: 1/{ways}{blocks}"
    return "replicated" if isinstance(layout, Replicate) else str(layout)


def _trailing(s: Statement, program: Program, full_shapes: dict[str, tuple]) -> str:
    notes = []
    if s.note:
        notes.append(s.note)
    if len(s.outputs) == 1 and s.outputs[0] in program.local_meta and s.outputs[0] in full_shapes:
        local = program.local_meta[s.outputs[0]].shape
        full = full_shapes[s.outputs[0]]
        if tuple(local) != tuple(full):
            notes.append(f"local {list(local)} of {list(full)}")
    return "  # " + comment_text("; ".join(notes)) if notes else ""


def build_module_view(
    program: Program,
    rank: int,
    cfg: ComputeConfig,
    model_name: str,
    policy: str,
    full_shapes: dict[str, tuple],
    version: str,
) -> ModuleView:
    """Everything the template needs to write gencode{rank}.py."""
    ways = program.ways
    tp_index = rank % cfg.plan_ngpus
    tp_group = cfg.dims.plan_group(rank)
    dp_group = cfg.dims.dp_group(rank)
    all_groups = cfg.dims.plan_groups() + cfg.dims.dp_groups()
    header = [
        f"Generated by nnscaler {version} for rank {rank} of {cfg.runtime_ngpus}. Regenerated per `reuse` when",
        "the model, the dummy inputs, the policy or the ComputeConfig change.",
        f"model:  {model_name}",
        f"policy: {policy}    plan: plan.json",
        f"config: ComputeConfig(plan_ngpus={cfg.plan_ngpus}, runtime_ngpus={cfg.runtime_ngpus})",
        f"groups: tensor-parallel {tp_group}; data-parallel {dp_group}",
    ]
    header = [comment_text(line) for line in header]  # names from the user's model: one line each
    param_names = {t.name for t in program.tensors}
    fmt = Formatter(
        tp_index,
        param_names,
        sync_batch_norm=cfg.runtime_ngpus > cfg.plan_ngpus,
        rank=rank,
        plan_ngpus=cfg.plan_ngpus,
        runtime_ngpus=cfg.runtime_ngpus,
        mesh=program.mesh,
    )
    shards, aliases = shard_lines(program.tensors, tp_index, ways, program.mesh, frozen_params([program]))
    sections, uses_checkpoint = build_sections(
        program, fmt, lambda s: _trailing(s, program, full_shapes), CodeLine, Section
    )
    out_refs = [fmt(r) for r in iter_refs(program.outputs)]
    spec = json.loads(program.out_spec) if program.out_spec else None
    is_leaf = spec is not None and spec[1].get("type") is None and not spec[1].get("children_spec")
    if is_leaf and len(out_refs) == 1:
        return_code, spec_json = out_refs[0], None
    else:
        return_code = f"pytree.tree_unflatten([{', '.join(fmt(o) for o in program.outputs)}], _OUT_SPEC)"
        spec_json = program.out_spec
    imports = [
        f"{m}  # registers the output type with pytree"
        for m in sorted({t.rsplit(".", 1)[0] for t in _spec_types(spec) if "." in t} if spec_json else set())
    ]
    imports += custom_op_imports(program.statements)
    groups = {"tp": tp_group, "dp": dp_group}
    if program.mesh:
        groups.update(rank_axis_groups(tp_group, program.mesh, rank))
        all_groups += [
            g
            for plan in cfg.dims.plan_groups()
            for axis in mesh_axis_groups(plan, program.mesh)
            for g in axis
        ]
    init_call = (
        f"super().__init__(rank={rank}, world_size={cfg.runtime_ngpus}, plan_ngpus={cfg.plan_ngpus}, "
        f"groups={json.dumps(groups)}, all_groups={all_groups})"
    )
    defaults = [f"{k}={v!r}" for k, v in program.untraced_args.items()]
    signature = ", ".join(["self"] + program.forward_args + defaults)
    unpack, in_spec_json = _unpack_inputs(program)
    view = ModuleView(
        header,
        imports,
        rank,
        init_call,
        shards,
        aliases,
        signature,
        sections,
        return_code,
        spec_json,
        fmt.used_sync_norm,
        any(s.op.startswith("rng.") or s.shard_rng for s in program.statements),
        unpack,
        in_spec_json,
        uses_checkpoint,
    )
    view.uses_math = uses_math([(s.args, s.kwargs) for s in program.statements])
    view.mesh_groups = [f"tp_axis{k}" for k in range(len(program.mesh))]
    if cfg.use_end2end:
        view.class_attrs = end2end_attrs(program.forward_args, 1, rank)
        view.train_step, view.infer_step = plain_train_lines(), plain_infer_lines()
        view.schedule_doc = (
            "End-to-end mode without pipeline stages: forward and backward of each micro-batch in turn."
        )
    view.class_attrs += inference_attrs(cfg) + constants_attrs(spmd_constant_users(program))
    return view


def end2end_attrs(
    forward_args: list[str], nmicros: int, last_stage_rank: int, pipelined: bool = False
) -> list[str]:
    return [
        f"use_scheduler = {pipelined}",
        f"nmicros_per_scheduler_step = {nmicros}",
        f"forward_args = {tuple(forward_args)!r}",
        f"last_stage_rank = {last_stage_rank}  # holds the losses of a train_step",
    ]


def inference_attrs(cfg: ComputeConfig) -> list[str]:
    if not cfg.inference_only:
        return []
    return ["inference_only = True  # ComputeConfig(inference_only=True): forward only, no gradient reducer"]


def frozen_params(programs: list[Program]) -> set[str]:
    """Parameters the user froze (`requires_grad=False` when traced): registered without gradients."""
    return {
        t.name
        for p in programs
        for t in p.tensors
        if t.is_param and t.name in p.local_meta and not p.local_meta[t.name].requires_grad
    }


def shard_lines(
    tensors: list[LocalTensor],
    tp_index: int,
    ways: int,
    mesh: tuple[int, ...] = (),
    frozen: set[str] | frozenset[str] = frozenset(),
) -> tuple[list[ShardLine], list[str]]:
    """`add_shard` lines for this rank's parameters and buffers, and `add_alias` lines for tied names.
    Parameters named in `frozen` are registered with `requires_grad=False`."""
    shards = []
    for t in tensors:
        kind = "" if t.is_param else ", is_param=False" + ("" if t.persistent else ", persistent=False")
        if t.is_param and t.name in frozen:
            kind += ", requires_grad=False"
        code = (
            f"self.add_shard({literal(t.name)}, {literal(t.original_name)}, {tuple(t.full_shape)}, torch.{t.dtype}"
            f"{_shard_arg(t.layout, tp_index, ways, mesh)}{kind})"
        )
        comment = _shard_comment(t, t.layout, ways) + ("; frozen" if t.is_param and t.name in frozen else "")
        shards.append(ShardLine(code, comment))
    aliases = [
        f"self.add_alias({literal(a)}, {literal(t.original_name)})" for t in tensors for a in t.aliases
    ]
    return shards, aliases


def custom_op_imports(statements: list[Statement]) -> list[str]:
    """Modules to import so the custom ops the statements call are registered."""
    modules = {op_module(s.op) for s in statements if s.kind == "op" and not s.op.startswith("aten.")}
    return [f"{m}  # registers the custom ops called below" for m in sorted(m for m in modules if m)]


def _unpack_inputs(program: Program, rules: list | None = None) -> tuple[list[str], str | None]:
    """Plain tensor arguments are used by name; nested or non-tensor ones are flattened as traced;
    arguments left at their defaults when traced are checked; then input sizes are bound and checked
    against the traced shapes and the `rules` (default: the program's shape rules)."""
    lines, in_spec = _unpack_leaves(program)
    lines += size_check_lines(program.input_meta, program.size_names, program.static_shapes)
    rules = program.shape_rules if rules is None else rules
    lines += rule_check_lines(rules, program.size_names, program.input_meta)
    return lines, in_spec


def _unpack_leaves(program: Program) -> tuple[list[str], str | None]:
    check = []
    if program.untraced_args:
        given = ", ".join(f'"{k}": {k}' for k in program.untraced_args)
        check = [f"self.check_untraced_args({{{given}}}, {program.untraced_args!r})"]
    if program.input_leaves == program.forward_args:
        return check, None
    kwargs = ", ".join(f'"{a}": {a}' for a in program.forward_args)
    lines = check + [
        f"leaves, spec = pytree.tree_flatten(((), {{{kwargs}}}))",
        "self.check_input_structure(spec, _IN_SPEC)",
    ]
    lines += [f"{name} = leaves[{i}]" for i, name in enumerate(program.input_leaves) if name is not None]
    lines += [
        f"self.check_constant_input({i}, leaves[{i}], {value!r})  # traced as a constant"
        for i, value in ((int(k), v) for k, v in program.input_constants.items())
    ]
    return lines, program.in_spec


def _spec_types(spec) -> list[str]:
    out = []

    def walk(node):
        if isinstance(node, dict):
            if node.get("type"):
                out.append(node["type"])
            for child in node.get("children_spec", []):
                walk(child)

    if spec is not None:
        walk(spec[1])
    return out
