"""The values `TrainerArgs` checks and derives from its plain fields: the precision of each tensor
kind, and the three batch sizes (any two give the third)."""

from __future__ import annotations

from typing import Any

import torch

from nnscaler.config import ComputeConfig
from nnscaler.errors import ConfigError

__all__ = ["PRECISIONS", "TENSOR_KINDS", "resolve_precision", "resolve_batch_sizes"]

PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "none": None}
"""Precision names -> dtypes (`none`: leave the tensors as the model builds them)."""
TENSOR_KINDS = ("param", "buffer", "input")


def resolve_precision(value: Any) -> dict[str, str]:
    """`precision` as a name for each tensor kind (a string applies to all, None means `none`)."""
    if value is None:
        value = "none"
    if isinstance(value, str):
        value = dict.fromkeys(TENSOR_KINDS, value)
    if not isinstance(value, dict):
        raise ConfigError(f"precision must be a string or a mapping over {TENSOR_KINDS}, got {value!r}")
    for kind, p in value.items():
        if kind not in TENSOR_KINDS:
            raise ConfigError(f"precision.{kind}: unknown tensor kind; use {', '.join(TENSOR_KINDS)}")
        if p not in PRECISIONS:
            raise ConfigError(f"precision.{kind} must be one of {', '.join(PRECISIONS)}, got {p!r}")
    return {kind: value.get(kind, "none") for kind in TENSOR_KINDS}


def resolve_batch_sizes(
    micro: int, gbs: int | None, accum: int | None, compute_config: ComputeConfig
) -> tuple[int, int]:
    """(global_batch_size, grad_accumulation_steps) from micro_batch_size and either or both of them:
    global = micro x data-parallel replicas x accumulation steps (no accumulation if neither is given;
    0 counts as not given, nnScaler 0.8's convention)."""
    sf = compute_config.runtime_ngpus // compute_config.plan_ngpus
    gbs, accum = gbs or None, accum or None  # 0 means "derive it", as in nnScaler 0.8
    for name, value in (
        ("micro_batch_size", micro),
        ("global_batch_size", gbs),
        ("grad_accumulation_steps", accum),
    ):
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")
    if gbs is None and accum is None:
        accum = 1
    if gbs is None:
        gbs = micro * sf * accum
    if accum is None:
        accum, rem = divmod(gbs, micro * sf)
        if rem or not accum:
            raise ConfigError(
                f"global_batch_size ({gbs}) must be a multiple of micro_batch_size ({micro}) x data-parallel "
                f"replicas ({sf} = runtime_ngpus {compute_config.runtime_ngpus} // plan_ngpus "
                f"{compute_config.plan_ngpus})"
            )
    if gbs != micro * sf * accum:
        raise ConfigError(
            f"inconsistent batch sizes: global_batch_size ({gbs}) != micro_batch_size ({micro}) x data-parallel "
            f"replicas ({sf}) x grad_accumulation_steps ({accum}) = {micro * sf * accum}; give any two of them"
        )
    return gbs, accum
