"""Typed errors. Each names what was wrong (node, source line, config field) and how to fix it."""

from __future__ import annotations

__all__ = [
    "NnScalerError",
    "ConfigError",
    "TraceError",
    "PlanError",
    "PartitionError",
    "CodegenError",
    "CompileError",
    "CheckpointError",
]


class NnScalerError(Exception):
    """Base class of every error nnscaler raises on purpose."""


class ConfigError(NnScalerError, ValueError):
    """A configuration field has a bad value; the message names the field and the value."""


class TraceError(NnScalerError):
    """The model could not be captured, or an op cannot be handled; names the op and source line."""


class PlanError(NnScalerError):
    """A policy produced a plan that cannot be realised (e.g. a split the device count does not divide)."""


class PartitionError(NnScalerError):
    """A plan could not be turned into per-rank programs."""


class CodegenError(NnScalerError):
    """Generated code could not be rendered or did not parse."""


class CompileError(NnScalerError):
    """The compiled program does not compute what the model computes (`parallelize(..., verify=...)`);
    names the first module, graph node and source line where they part."""


class CheckpointError(NnScalerError, ValueError):
    """Checkpoint pieces cannot be merged or loaded as given (missing metadata, pieces of different
    plans, unpaired optimizer states, diverged replicas); names the pieces and what to do."""
