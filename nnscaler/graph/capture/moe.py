"""Recognise mixture-of-experts layers at capture: their experts run as one op.

A MoE block is router -> top-k -> dispatch -> experts -> combine. The router (a linear, softmax or
sigmoid, top-k, group-limited top-k in DeepSeek-V3, the normalisation of the weights, the auxiliary
losses) stays the model's own code, captured op by op. The experts part (dispatch, the expert MLPs,
combine) is what every implementation writes differently (a Python loop over experts, a sort and
grouped matmuls, index_add or scatter): it is recognised by its module's contract and traced as one
op, `torch.ops.nnscaler.moe_experts` (nnscaler.runtime.moe), whose annotation has an expert dim.

The contract (transformers' fused experts: Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, and a
hand-written module that follows it): parameters `gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]`,
no biases, an `act_fn` module of a known activation, and `forward(hidden [T, H], top_k_index [T, K],
top_k_weights [T, K]) -> [T, H]`. Modules that differ (biases, other activations) are left as they
are (their ops are captured one by one, split like linears).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["ExpertsOpForward", "experts_activation", "is_experts_module", "experts_as_op", "use_moe_op"]

_ACTIVATION_CLASSES = {
    "SiLU": "silu",
    "SiLUActivation": "silu",
    "GELU": "gelu",
    "GELUActivation": "gelu",
    "GELUTanh": "gelu_tanh",
    "NewGELUActivation": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "ReLU": "relu",
}
_FORWARD_ARGS = ["hidden_states", "top_k_index", "top_k_weights"]


def experts_activation(module: nn.Module) -> str | None:
    """The op's activation name for the module's `act_fn`, or None when unknown."""
    act = getattr(module, "act_fn", None)
    if isinstance(act, nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    return _ACTIVATION_CLASSES.get(type(act).__name__) if act is not None else None


def is_experts_module(module: nn.Module) -> bool:
    """Does the module follow the fused-experts contract (module docstring)?"""
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    if not isinstance(gate_up, nn.Parameter) or not isinstance(down, nn.Parameter):
        return False
    if gate_up.dim() != 3 or down.dim() != 3 or experts_activation(module) is None:
        return False
    e, two_i, h = gate_up.shape
    if down.shape != (e, h, two_i // 2) or two_i % 2:
        return False
    if any(getattr(module, b, None) is not None for b in ("gate_up_proj_bias", "down_proj_bias")):
        return False
    try:
        params = list(inspect.signature(type(module).forward).parameters)[1:]
    except (TypeError, ValueError):
        return False
    return params[:3] == _FORWARD_ARGS


class ExpertsOpForward:
    """An experts module's forward through `moe_experts`, installed as its instance `forward`.

    An object holding its module, not a closure: `copy.deepcopy` and `pickle` copy the reference along
    with the module (the module is in their memo first), so a copy of the model runs its own experts'
    weights and its gradients land on them. A closure would be copied by reference (functions are
    atomic to deepcopy and cannot be pickled) and keep computing with the original's."""

    def __init__(self, module: nn.Module, capacity_factor: float | None):
        self.module = module
        self.capacity_factor = capacity_factor

    def __call__(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        from nnscaler.runtime.moe.op import moe_experts  # registers the op

        module = self.module
        return moe_experts(
            hidden_states,
            top_k_index,
            top_k_weights,
            module.gate_up_proj,
            module.down_proj,
            experts_activation(module),
            self.capacity_factor,
        )

    def __repr__(self) -> str:
        return f"ExpertsOpForward({type(self.module).__name__}, capacity_factor={self.capacity_factor})"


def _op_forward(module: nn.Module, capacity_factor: float | None) -> ExpertsOpForward:
    from nnscaler.runtime.moe.op import moe_experts  # noqa: F401 - registers the op before capture

    return ExpertsOpForward(module, capacity_factor)


def _switched(module: nn.Module) -> bool:
    """Whether `use_moe_op` switched this module (its own forward is an ExpertsOpForward of itself)."""
    forward = module.__dict__.get("forward")
    return isinstance(forward, ExpertsOpForward) and forward.module is module


def _experts_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, sub in model.named_modules():
        if is_experts_module(sub):
            yield name, sub


def use_moe_op(model: nn.Module, capacity_factor: float | None = None) -> list[str]:
    """Run every recognised experts module of `model` through the op from now on (eagerly too), with
    this capacity rule (None: dropless); returns their module paths. Capture does this by itself
    (dropless) for modules not already switched."""
    if capacity_factor is not None and capacity_factor <= 0:
        raise ValueError(f"use_moe_op: capacity_factor must be > 0 or None (dropless), got {capacity_factor}")
    names = []
    for name, sub in _experts_modules(model):
        sub.forward = _op_forward(sub, capacity_factor)
        names.append(name)
    return names


@contextlib.contextmanager
def experts_as_op(model: nn.Module) -> Iterator[list[str]]:
    """While capturing: recognised experts modules not switched by `use_moe_op` run through the op
    (dropless); their own forward is back afterwards. Yields the module paths."""
    switched: list[tuple[nn.Module, Any]] = []
    names = []
    for name, sub in _experts_modules(model):
        names.append(name)
        if _switched(sub):
            continue
        switched.append((sub, sub.__dict__.get("forward")))
        sub.forward = _op_forward(sub, None)
    try:
        yield names
    finally:
        for sub, old in switched:
            if old is None:
                del sub.forward
            else:
                sub.forward = old
