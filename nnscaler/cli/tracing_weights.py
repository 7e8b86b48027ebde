"""`tracing_from_weights`: start the model (or a parallelized sub-module) from a saved state dict.

As in nnScaler 0.8, the weights are loaded into the plain module before it is traced, so the
parallel module starts from them: `TrainerArgs.tracing_from_weights` is a state-dict file of the
whole model; a `model.parallel_modules[]` entry takes its own file (`tracing_from_weights`) or the
keys under `tracing_from_weights_prefix` of the model-level file.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nnscaler.errors import ConfigError

__all__ = ["load_model_weights", "load_sub_module_weights"]


def _read(path: str, what: str) -> dict[str, Any]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001  (a truncated or foreign file: zip, pickle or EOF errors)
        raise ConfigError(
            f"{what}: cannot read the state dict {path!r} ({type(err).__name__}: {err}); it is missing, "
            "truncated or not a torch file: save it again with torch.save(model.state_dict(), path)"
        ) from err
    if not isinstance(state, dict):
        raise ConfigError(f"{what}: {path!r} holds a {type(state).__name__}, not a state dict")
    return state


def _load(module: nn.Module, state: dict[str, Any], what: str) -> None:
    try:
        module.load_state_dict(state)
    except RuntimeError as err:
        raise ConfigError(f"{what}: the weights do not fit {type(module).__name__}: {err}") from err


def load_model_weights(args: Any, model: nn.Module) -> None:
    """Load `args.tracing_from_weights` into the whole model (nothing when unset)."""
    if args.tracing_from_weights:
        _load(model, _read(args.tracing_from_weights, "tracing_from_weights"), "tracing_from_weights")


def load_sub_module_weights(args: Any, entry: Any, sub: nn.Module) -> None:
    """Load a `model.parallel_modules[]` entry's weights into `sub`, one of its sub-modules."""
    what = f"model.parallel_modules[{entry.type}]"
    if entry.tracing_from_weights:
        _load(sub, _read(entry.tracing_from_weights, f"{what}.tracing_from_weights"), what)
    elif entry.tracing_from_weights_prefix:
        lead = entry.tracing_from_weights_prefix + "."
        full = _read(args.tracing_from_weights, "tracing_from_weights")
        picked = {k[len(lead) :]: v for k, v in full.items() if k.startswith(lead)}
        if not picked:
            raise ConfigError(
                f"{what}.tracing_from_weights_prefix {entry.tracing_from_weights_prefix!r}: no key of "
                f"{args.tracing_from_weights!r} starts with {lead!r}"
            )
        _load(sub, picked, what)
