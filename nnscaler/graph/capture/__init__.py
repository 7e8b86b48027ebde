"""Capture: torch.export a module and convert the program into our Graph."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from nnscaler.errors import TraceError
from nnscaler.graph.capture.attention_fuse import fuse_attention
from nnscaler.graph.capture.autograd_fn import name_autograd_functions, opaque_autograd_functions
from nnscaler.graph.capture.budget import capture_within_budget
from nnscaler.graph.capture.convert import convert_exported
from nnscaler.graph.capture.ctc_loss import ctc_loss_shapes
from nnscaler.graph.capture.export import check_forward_args, export_module, untraced_defaults
from nnscaler.graph.capture.functionalize import functionalize
from nnscaler.graph.capture.leaf_modules import capture_with_leaves, mark_leaf_nodes
from nnscaler.graph.capture.local_checks import localize_value_checks
from nnscaler.graph.capture.modes import trace_both_modes
from nnscaler.graph.capture.moe import experts_as_op
from nnscaler.graph.capture.side_effects import watch_side_effects
from nnscaler.graph.capture.symbolic import dynamic_shapes_spec
from nnscaler.graph.capture.value_checks import trace_value_checks
from nnscaler.graph.ir import Graph

__all__ = ["capture", "check_forward_args", "export_module", "convert_exported"]

logger = logging.getLogger(__name__)


def capture(
    module: torch.nn.Module,
    dummy_forward_args: dict[str, Any],
    static_shapes: bool = False,
    both_modes: bool = True,
    leaf_modules: Sequence[str] = (),
    auto_leaf_modules: bool = True,
    constant_folding: bool = False,
    trace_time_budget_s: float | None = 30.0,
    refuse_side_effects: str | None = None,
) -> Graph:
    """Trace `module(**dummy_forward_args)` into a Graph without touching its weights.

    Dummy inputs are examples, never identities: two arguments given the same tensor (or views of
    one) are traced as two inputs. Unless `static_shapes`, every input dim may change between calls:
    sizes derived from input shapes stay expressions (with their traced values as hints).
    `constant_folding` (ComputeConfig.constant_folding) traces the same way and marks the graph
    (`Graph.static_shapes`) so the generated code folds the sizes it computes with into constants;
    a model that fails to convert with sizes open is traced again with every size fixed.
    Unless `both_modes` is False, the module is traced in train and in eval mode (twice the time) so
    the program follows train()/eval() at run time; planning alone (`python -m nnscaler.plan`) needs
    only the module's own mode, and its node names are the same.
    `leaf_modules` (paths or class names) run as one opaque op each; with `auto_leaf_modules`, so does
    a submodule whose code export refuses as data-dependent (graph/capture/leaf_modules.py).
    `trace_time_budget_s` (ComputeConfig.trace_time_budget_s; None or 0: no limit) bounds all of the
    tracing with sizes left open (both modes, leaf retries, constant folding's retry): past it, the
    module is traced again with every size fixed and a TraceBudgetWarning names the line the trace was
    at (graph/capture/budget.py).
    `refuse_side_effects` (the setting, e.g. 'ComputeConfig.torch_compile'): forward changing plain model
    attributes raises a ConfigError naming them, instead of a SideEffectWarning (capture/side_effects.py).
    """
    options = (both_modes, tuple(leaf_modules), auto_leaf_modules, refuse_side_effects)
    if static_shapes:
        return _capture(module, dummy_forward_args, True, *options)
    open_sizes = lambda: _open_sizes(module, dummy_forward_args, constant_folding, options)  # noqa: E731
    fixed = lambda: _capture(module, dummy_forward_args, True, *options)  # noqa: E731
    return capture_within_budget(trace_time_budget_s, open_sizes, fixed, module, dummy_forward_args)


def _open_sizes(
    module: torch.nn.Module, dummy_forward_args: dict[str, Any], constant_folding: bool, options: tuple
) -> Graph:
    """The trace with sizes left open (under capture's time budget); with constant folding, a model
    that fails that way is traced again with every size fixed."""
    if not constant_folding:
        return _capture(module, dummy_forward_args, False, *options)
    try:
        graph = _capture(module, dummy_forward_args, False, *options)
    except TraceError as exc:  # e.g. a size that depends on tensor values: fixed sizes may still work
        logger.info("constant_folding=True: tracing with every size fixed, as open sizes failed (%s)", exc)
        graph = _capture(module, dummy_forward_args, True, *options)
    return dataclasses.replace(graph, static_shapes=True)


def _capture(
    module: torch.nn.Module,
    dummy_forward_args: dict[str, Any],
    static_shapes: bool,
    both_modes: bool,
    leaf_modules: Sequence[str],
    auto_leaf_modules: bool,
    refuse_side_effects: str | None = None,
) -> Graph:
    forward_args = check_forward_args(module, dummy_forward_args)
    kwargs = {k: dummy_forward_args[k] for k in forward_args}
    device = _trace_device(module)
    kwargs = pytree.tree_map(lambda v: _own_copy(v, device), kwargs)
    dynamic = None if static_shapes else dynamic_shapes_spec(kwargs)
    # custom autograd Functions keep their backward; the program follows train()/eval()
    # ...and forward's changes to plain attributes (`self.calls += 1`), which no trace keeps, warn
    # ...and the experts of mixture-of-experts layers trace as one op (graph/capture/moe.py)
    # ...and value checks that only raise (`if labels.max() >= n: raise`) trace as run-time checks;
    # F.ctc_loss traces as one op (capture/ctc_loss.py)
    with (
        experts_as_op(module),
        opaque_autograd_functions(),
        watch_side_effects(module, refuse=refuse_side_effects),
        trace_value_checks(),
        ctc_loss_shapes(),
    ):
        # writes into views become ops on their base (torch's functionalization), in each mode
        export = lambda: functionalize(export_module(module, kwargs, dynamic))  # noqa: E731
        trace = (lambda ex: trace_both_modes(module, ex, kwargs)) if both_modes else (lambda ex: ex())
        # ...and submodules it cannot capture (named, or failing on data-dependent code) stay opaque
        ep, leaves = capture_with_leaves(module, kwargs, export, trace, leaf_modules, auto_leaf_modules)
    graph = mark_leaf_nodes(name_autograd_functions(convert_exported(ep, module, forward_args)), leaves)
    graph = fuse_attention(graph)  # attention written by hand becomes one SDPA node (attention_fuse.py)
    graph = localize_value_checks(graph)  # checks on computed tensors: element-wise (local_checks.py)
    return dataclasses.replace(
        graph, untraced_args=untraced_defaults(module, forward_args), static_shapes=static_shapes
    )


def _trace_device(module: torch.nn.Module) -> torch.device | None:
    """Where the dummy inputs are traced: on the module's weights' device (meta weights: meta), so a
    module built on the CPU traces with inputs already on a GPU (the generated code allocates on the
    runtime's device, whatever the trace saw). None: no weights, or weights on several devices."""
    devices = {t.device for t in (*module.parameters(), *module.buffers())}
    if any(d.type == "meta" for d in devices):
        return torch.device("meta")
    return devices.pop() if len(devices) == 1 else None


def _own_copy(value: Any, device: torch.device | None) -> Any:
    """A tensor of its own (torch.export traces one tensor passed as two arguments as one input), on
    the trace device."""
    if not isinstance(value, torch.Tensor):
        return value
    stays = device is None or value.device == device or value.is_meta
    copy = value.detach().clone() if stays else value.detach().to(device)
    return copy.requires_grad_(value.requires_grad) if value.is_floating_point() else copy
