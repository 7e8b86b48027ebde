"""Capture: torch.export a module and convert the program into our Graph."""

from __future__ import annotations

from typing import Any

import torch

from nnscaler.graph.capture.convert import convert_exported
from nnscaler.graph.capture.export import check_forward_args, export_module, untraced_defaults
from nnscaler.graph.ir import Graph

__all__ = ["capture", "check_forward_args", "export_module", "convert_exported"]


def capture(module: torch.nn.Module, dummy_forward_args: dict[str, Any]) -> Graph:
    """Trace `module(**dummy_forward_args)` into a Graph without touching its weights."""
    forward_args = check_forward_args(module, dummy_forward_args)
    kwargs = {k: dummy_forward_args[k] for k in forward_args}
    if any(p.is_meta for p in module.parameters()):
        kwargs = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    was_training = module.training
    ep = export_module(module, kwargs)
    module.train(was_training)
    graph = convert_exported(ep, module, forward_args)
    graph.untraced_args = untraced_defaults(module, forward_args)
    return graph
