"""Writes into activations, made functional by torch's own functionalization.

torch.export's training IR keeps a model's in-place ops as they are: `x[:, 1:] = y` is
`copy_(slice(x, 1, 1), y)`, a write through a view that changes `x`. Every later stage of the
compiler reasons about values, so such a program is handed to torch's functionalization
(`ExportedProgram.run_decompositions({})`: functional ATen, high-level ops such as `linear` and
`scaled_dot_product_attention` kept): a write into a view becomes `slice_scatter` /
`select_scatter` / `index_put` / `copy` on the base, and later readers read the result.

Functionalization also turns the model's updates of its own state into program outputs (batch
norm's running statistics, `num_batches_tracked += 1`, writes into an input). Those are put back
in place here, in the form the rest of capture knows from the training IR: the functional batch
norm ops become `aten.batch_norm` (which updates its running statistics itself), a buffer counter
becomes `add_` on the buffer, and any other update a `copy_` into the buffer, parameter or input at
the end of the program. Only parameter, buffer and input updates stay in place.

The retrace costs about as much as the export, so programs without a write into an activation
(most decoder LMs) are left as they are: in-place ops on parameters, buffers and inputs alone
already mean what they say.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
from torch.export.graph_signature import InputKind, OutputKind

__all__ = ["writes_into_activations", "functionalize"]

_STATE_INPUTS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.USER_INPUT)
_STATE_OUTPUTS = (OutputKind.BUFFER_MUTATION, OutputKind.USER_INPUT_MUTATION)
if hasattr(OutputKind, "PARAMETER_MUTATION"):
    _STATE_OUTPUTS = (*_STATE_OUTPUTS, OutputKind.PARAMETER_MUTATION)

_aten = torch.ops.aten


def _written_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes an aten op writes into (its `Tensor(a!)` arguments)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return []
    out = []
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if isinstance(value, torch.fx.Node):
            out.append(value)
    return out


def _graphs(gm: torch.fx.GraphModule) -> list[torch.fx.Graph]:
    """The program's graph and those of its higher-order regions (no_grad, autocast bodies)."""
    out = [gm.graph]
    for sub in gm.children():
        if isinstance(sub, torch.fx.GraphModule):
            out.extend(_graphs(sub))
    return out


def writes_into_activations(ep: torch.export.ExportedProgram) -> bool:
    """True when an op writes into a tensor the program computed (or a view of a parameter,
    buffer or input), rather than into a parameter, buffer or input itself."""
    state = {s.arg.name for s in ep.graph_signature.input_specs if s.kind in _STATE_INPUTS}
    for graph in _graphs(ep.graph_module):
        top = graph is ep.graph
        for node in graph.nodes:
            for target in _written_args(node):
                if not (top and target.op == "placeholder" and target.name in state):
                    return True
    return False


def functionalize(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """The program in functional ATen where it writes into activations; as it is otherwise."""
    if not writes_into_activations(ep):
        return ep
    _swap_targets(ep, _KEPT)
    try:
        functional = ep.run_decompositions({})
    finally:
        _swap_targets(ep, {v: k for k, v in _KEPT.items()})
    _swap_targets(functional, {v: k for k, v in _KEPT.items()})
    _put_state_updates_in_place(functional)
    _views_as_reshapes(functional)
    _copies_as_values(functional)
    functional.graph_module.recompile()
    return functional


def _copies_as_values(ep: torch.export.ExportedProgram) -> None:
    """`aten.copy(self, src)` -> src broadcast to self's shape, in self's dtype.

    Functionalization writes `dst[...].copy_(src)` as `copy(dst[...], src)` and then scatters its
    result into the base; `aten.copy` has no derivative in eager autograd, so the generated code
    computes the same value with ops that have one (`expand_as`, `to`), or takes src as it is."""
    for graph in _graphs(ep.graph_module):
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not _aten.copy.default:
                continue
            dst, src = node.args[0], node.args[1]
            want, have = dst.meta.get("val"), src.meta.get("val") if isinstance(src, torch.fx.Node) else None
            if want is None or have is None:
                continue
            value = src
            with graph.inserting_before(node):
                if tuple(have.shape) != tuple(want.shape):
                    value = graph.call_function(_aten.expand_as.default, (value, dst))
                    value.meta = {**node.meta, "val": have.expand_as(want)}
                if have.dtype != want.dtype:
                    value = graph.call_function(_aten._to_copy.default, (value,), {"dtype": want.dtype})
                    value.meta = dict(node.meta)
            node.replace_all_uses_with(value)
            graph.erase_node(node)


def _views_as_reshapes(ep: torch.export.ExportedProgram) -> None:
    """`view` -> `reshape`: functional ATen drops the `contiguous()` calls that made a view legal
    (values, not memory layouts, are what it keeps), so a view of a transposed tensor must be
    allowed to copy. reshape is a view wherever view would have been one."""
    for graph in _graphs(ep.graph_module):
        for node in graph.nodes:
            if node.op == "call_function" and node.target in (_aten.view.default, _aten._unsafe_view.default):
                node.target = _aten.reshape.default


def _kept_op(name: str, aten_op: Any) -> Any:
    """A custom op with `aten_op`'s (input, p, train) schema, which functionalization leaves alone."""

    def run(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
        return aten_op(input, p, train)

    op = torch.library.custom_op(f"nnscaler_capture::{name}", run, mutates_args=())
    op.register_fake(lambda input, p, train: torch.empty_like(input))
    return op._opoverload


# Ops kept as they are through functionalization. Their decompositions differ by mode (dropout is
# native_dropout in train mode and a clone in eval mode), and the two modes' programs must keep
# calling the same op, with `train` the only difference, for the compiled code to follow
# train()/eval(). Each is hidden behind a custom op of the same schema while torch functionalizes.
_KEPT = {
    getattr(_aten, name).default: _kept_op(name, getattr(_aten, name).default)
    for name in ("dropout", "alpha_dropout", "feature_dropout", "feature_alpha_dropout")
}


def _swap_targets(ep: torch.export.ExportedProgram, targets: dict[Any, Any]) -> None:
    for graph in _graphs(ep.graph_module):
        for node in graph.nodes:
            if node.op == "call_function" and node.target in targets:
                node.target = targets[node.target]
    ep.graph_module.recompile()


def _put_state_updates_in_place(ep: torch.export.ExportedProgram) -> None:
    """Turn the functional program's state-update outputs back into in-place updates (see module doc)."""
    graph = ep.graph
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    _restore_batch_norms(graph)
    output = next(n for n in graph.nodes if n.op == "output")
    flat = list(output.args[0])
    specs = list(ep.graph_signature.output_specs)
    kept_values, kept_specs = [], []
    for spec, value in zip(specs, flat):
        if spec.kind not in _STATE_OUTPUTS:
            kept_values.append(value)
            kept_specs.append(spec)
            continue
        target = placeholders[_input_name(ep, spec)]
        if value is target:
            continue  # updated in place already (batch norm's running statistics)
        if _is_counter_of(value, target):
            value.target = _aten.add_.Tensor  # num_batches_tracked + 1 -> num_batches_tracked += 1
            continue
        with graph.inserting_before(output):
            copy = graph.call_function(_aten.copy_.default, (target, value))
        copy.meta["val"] = target.meta.get("val")
        copy.meta["stack_trace"] = value.meta.get("stack_trace") if isinstance(value, torch.fx.Node) else None
        copy.meta["nn_module_stack"] = (
            value.meta.get("nn_module_stack", {}) if isinstance(value, torch.fx.Node) else {}
        )
    output.args = (tuple(kept_values),)
    ep.graph_signature.output_specs[:] = kept_specs


def _input_name(ep: torch.export.ExportedProgram, spec) -> str:
    """The placeholder a state-update output writes back to."""
    for ispec in ep.graph_signature.input_specs:
        if spec.kind == OutputKind.USER_INPUT_MUTATION and ispec.arg.name == spec.target:
            return ispec.arg.name
        if spec.kind != OutputKind.USER_INPUT_MUTATION and ispec.target == spec.target:
            return ispec.arg.name
    raise KeyError(f"no input of the program is updated as {spec.target!r}")


def _is_counter_of(value, target: torch.fx.Node) -> bool:
    """`target + 1` (a batch norm's num_batches_tracked) used by nothing but the program's output."""
    return (
        isinstance(value, torch.fx.Node)
        and value.target in (_aten.add.Tensor, _aten.add.Scalar)
        and value.args[0] is target
        and isinstance(value.args[1], (int, float))
        and len(value.users) == 1
    )


# The functional batch norms and what `aten.batch_norm` call each one is:
# op -> (input positions of x, weight, bias, running_mean, running_var, training, momentum, eps)
_BATCH_NORMS = {
    _aten._native_batch_norm_legit_functional.default: (0, 1, 2, 3, 4, 5, 6, 7),
    _aten._native_batch_norm_legit_no_training.default: (0, 1, 2, 3, 4, False, 5, 6),
    _aten._native_batch_norm_legit.no_stats: (0, 1, 2, None, None, 3, 4, 5),
}


def _restore_batch_norms(graph: torch.fx.Graph) -> None:
    """A functional batch norm whose only used results are its output and new running statistics
    becomes `aten.batch_norm` (which updates the statistics in place), as in the training IR."""
    for node in list(graph.nodes):
        positions = _BATCH_NORMS.get(node.target) if node.op == "call_function" else None
        if positions is None:
            continue
        items = {}
        for user in node.users:
            if user.target is not operator.getitem:
                break
            items.setdefault(user.args[1], []).append(user)
        else:
            if items.keys() - {0, 3, 4}:
                continue  # the saved mean / inverse std are read: keep the functional op
            args = [p if isinstance(p, bool) else None if p is None else node.args[p] for p in positions]
            with graph.inserting_before(node):
                bn = graph.call_function(_aten.batch_norm.default, (*args, False))
            bn.meta = {**node.meta, "val": node.meta["val"][0]}
            for k, getters in items.items():
                replacement = bn if k == 0 else args[k]
                for getter in getters:
                    getter.replace_all_uses_with(replacement)
                    graph.erase_node(getter)
            graph.erase_node(node)
