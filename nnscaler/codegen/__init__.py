"""Codegen: view models + Jinja templates -> one readable gencode{rank}.py per runtime rank."""

from __future__ import annotations

from nnscaler.codegen.pipeline_view import build_pipeline_view
from nnscaler.codegen.render import render_module, write_atomic
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
) -> str:
    """The source of gencode{rank}.py."""
    if isinstance(program, PipelineProgram):
        return render_module(
            build_pipeline_view(program, rank, cfg, model_name, policy, full_shapes, version)
        )
    return render_module(build_module_view(program, rank, cfg, model_name, policy, full_shapes, version))
