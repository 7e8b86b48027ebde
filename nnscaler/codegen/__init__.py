"""Codegen: view models + Jinja templates -> one readable gencode{rank}.py per runtime rank."""

from __future__ import annotations

from nnscaler.atomic_files import write_atomic
from nnscaler.codegen.leaf_code import leaf_module_lines
from nnscaler.codegen.pipeline_view import build_pipeline_view
from nnscaler.codegen.render import render_module
from nnscaler.codegen.view_model import ModuleView, build_module_view
from nnscaler.config import ComputeConfig
from nnscaler.partition import PipelineProgram, Program

__all__ = ["render_module", "write_atomic", "ModuleView", "build_module_view", "generate_code"]


def generate_code(
    program: Program | PipelineProgram,
    rank: int,
    cfg: ComputeConfig,
    model_name: str,
    policy: str,
    full_shapes: dict[str, tuple],
    version: str,
    plan_fingerprint: str | None = None,
    layer_functions: bool = True,
) -> str:
    """The source of gencode{rank}.py; `plan_fingerprint` (the same for every rank) goes into the class,
    so checkpoints name the plan they were saved under. `layer_functions`: repeated layers that share
    their code are written once, as methods called per layer (False: every layer inline, every value a
    local of the forward)."""
    build = build_pipeline_view if isinstance(program, PipelineProgram) else build_module_view
    view = build(program, rank, cfg, model_name, policy, full_shapes, version, layer_functions)
    imports, attrs = leaf_module_lines(program)  # opaque leaf modules: the runtime's `leaf.call`
    view.imports += imports
    view.class_attrs += attrs
    if plan_fingerprint is not None:
        view.class_attrs.append(f"plan_fingerprint = {plan_fingerprint!r}  # names the plan in checkpoints")
    return render_module(view)
