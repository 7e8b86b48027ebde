"""The keys and format tags of nnscaler's state dicts, shared by the module that writes them and the
checkpoint code that reads them (a leaf: it imports nothing)."""

from __future__ import annotations

from typing import Any

__all__ = [
    "EXTRA_STATE_FORMAT",
    "EXTRA_STATE_KEY",
    "OPTIMIZER_META_FORMAT",
    "OPTIMIZER_META_KEY",
    "ZERO_SLICES_KEY",
    "PARALLEL_MODULE_FLAG",
    "is_parallel_module",
]

EXTRA_STATE_FORMAT = "nnscaler.ParallelModule/1"
"""Format tag of a ParallelModule's `_extra_state` (rank, plan, sharding of every tensor)."""
EXTRA_STATE_KEY = "_extra_state"
"""Key (after the module's prefix) of that extra state in a model state dict."""
OPTIMIZER_META_KEY = "nnscaler"
"""Top-level key of the metadata in an optimizer state dict."""
OPTIMIZER_META_FORMAT = "nnscaler.optimizer/1"
ZERO_SLICES_KEY = "zero_slices"
"""Param-group key of a ZeRO optimizer state dict: which slice of each parameter this rank holds."""

PARALLEL_MODULE_FLAG = "_nnscaler_parallel_module"
"""Class attribute set on ParallelModule: lets code below the module (checkpoint metadata, ZeRO) tell
one apart without importing it."""


def is_parallel_module(module: Any) -> bool:
    """Whether `module` is a ParallelModule (generated code or a subclass)."""
    return getattr(type(module), PARALLEL_MODULE_FLAG, False) is True
