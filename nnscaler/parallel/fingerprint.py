"""What decides whether generated code can be reused: model, dummy inputs, policy, config, version."""

from __future__ import annotations

import hashlib
import inspect
import json
from typing import Any

import torch

from nnscaler.config import ComputeConfig

__all__ = ["fingerprint"]


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return {"tensor": list(value.shape), "dtype": str(value.dtype)}
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _describe(v) for k, v in value.items()}
    return repr(value)


def _source_hash(module: torch.nn.Module) -> str:
    try:
        return hashlib.sha256(inspect.getsource(type(module)).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        return "unknown"


def fingerprint(
    module: torch.nn.Module, dummy_forward_args: dict, policy: str, cfg: ComputeConfig, version: str
) -> dict[str, Any]:
    """A JSON-able description; generated code is reused only when it is equal."""
    return {
        "version": version,
        "module": f"{type(module).__module__}.{type(module).__qualname__}",
        "module_source": _source_hash(module),
        "state": {k: [list(v.shape), str(v.dtype)] for k, v in module.state_dict().items()},
        "training": module.training,
        "dummy_forward_args": _describe(dummy_forward_args),
        "policy": policy,
        "compute_config": json.loads(json.dumps(cfg.to_dict(), default=str)),
    }
