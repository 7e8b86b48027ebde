"""How the Trainer turns a training sample into the model's forward arguments.

Two conventions, decided once from the forward's signature and the first sample:

- keyword (ours): the sample's keys are forward parameters, `forward(**sample)`;
- whole sample (nnScaler 0.8's): a forward with exactly one parameter (besides self) whose name is
  not the sample's only key gets the whole sample, `forward(data=sample)` (nnScaler's
  `{arg_names[1]: sample}`).

Anything else is a ConfigError naming the forward's signature and the sample's keys.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from nnscaler.errors import ConfigError

__all__ = ["ForwardConvention", "forward_convention"]


@dataclass(frozen=True)
class ForwardConvention:
    """`wrap_as`: the parameter that receives the whole sample (None: the sample's keys are the arguments)."""

    wrap_as: str | None = None

    def __call__(self, sample: Any) -> Any:
        """The forward arguments (a dict of parameter name -> value) of one sample."""
        return sample if self.wrap_as is None else {self.wrap_as: sample}


def _params(module: torch.nn.Module) -> tuple[inspect.Signature, list[inspect.Parameter], bool]:
    sig = inspect.signature(module.forward)
    named = [p for p in sig.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    var_kw = any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
    return sig, named, var_kw


def forward_convention(module: torch.nn.Module, sample: Any) -> ForwardConvention:
    """The convention `module.forward` takes `sample` (a training sample, usually a dict) by."""
    sig, named, var_kw = _params(module)
    where = f"{type(module).__name__}.forward{sig}"
    keys = list(sample) if isinstance(sample, dict) else None
    if len(named) == 1 and (
        keys is None or keys != [named[0].name] and not (var_kw and named[0].name in keys)
    ):
        return ForwardConvention(wrap_as=named[0].name)
    if keys is None:
        raise ConfigError(
            f"a training sample is a {type(sample).__name__}, but {where} takes "
            f"{len(named)} parameters: return dicts keyed by its parameter names from the dataset "
            "(or dataloader collate_fn), or give forward one parameter that takes the whole sample"
        )
    required = [p.name for p in named if p.default is p.empty]
    missing = [n for n in required if n not in keys]
    if not missing:
        return ForwardConvention()
    raise ConfigError(
        f"{where} cannot take the training sample with keys {keys}: parameter(s) {missing} are not "
        "among them. Either name forward's parameters after the sample's keys (each gets its value), "
        "or give forward exactly one parameter (it gets the whole sample, as in nnScaler 0.8)"
    )
