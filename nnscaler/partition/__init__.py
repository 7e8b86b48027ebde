"""Partition: per-rank programs from a graph and a plan, with communication between layouts."""

from nnscaler.partition.apply_plan import apply_plan, local_shape
from nnscaler.partition.convert import GROUP, AxisGroup, conversion_steps
from nnscaler.partition.pipeline import PipelineProgram, StageProgram, apply_pipeline
from nnscaler.partition.program import LocalTensor, Program, RankScaled, Statement

__all__ = [
    "apply_plan",
    "apply_pipeline",
    "PipelineProgram",
    "StageProgram",
    "local_shape",
    "GROUP",
    "AxisGroup",
    "conversion_steps",
    "LocalTensor",
    "Program",
    "RankScaled",
    "Statement",
]
