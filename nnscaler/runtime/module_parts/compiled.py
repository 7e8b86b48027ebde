"""`ComputeConfig.torch_compile`: the generated code's entry points run through `torch.compile`.

The generated file stays plain PyTorch; what is compiled is this instance's `forward` and, with
pipeline stages, each `stage{k}` method (the layer functions they call are inlined by dynamo). The
schedule (`_train_step` / `_infer_step`), the hooks around forward (input checks, ZeRO-3 gathers,
the gradient reducer) and the optimizer stay eager. Communication inside a forward is traced too:
dynamo turns the `torch.distributed` calls of nnscaler.runtime.comm's autograd Functions into
functional collectives (measured on torch 2.13, gloo: one graph, no break, for gpt under tp); where a
torch release cannot trace one, dynamo breaks the graph there and runs it eagerly.
"""

from __future__ import annotations

import re
from typing import Any

import torch

__all__ = ["STAGE_METHOD", "compile_options", "compiled_methods", "compile_generated"]

STAGE_METHOD = re.compile(r"stage\d+")
"""Names of the generated pipeline stage methods."""


def compile_options(value: bool | dict[str, Any] | None) -> dict[str, Any] | None:
    """`ComputeConfig.torch_compile` as keyword arguments of `torch.compile` (None: do not compile)."""
    if not value:
        return None
    options = {} if value is True else dict(value)
    if options.get("disable"):
        return None
    options.pop("disable", None)
    return options


def compiled_methods(module: torch.nn.Module) -> list[str]:
    """The methods `compile_generated` wraps: `forward` and every `stage{k}` of the generated class."""
    stages = sorted((n for n in vars(type(module)) if STAGE_METHOD.fullmatch(n)), key=lambda n: int(n[5:]))
    return ["forward", *stages]


def compile_generated(module: torch.nn.Module, value: bool | dict[str, Any] | None) -> list[str]:
    """Replace this instance's `forward` / `stage{k}` by their `torch.compile`d versions (compiled
    lazily, on the first call). Returns the wrapped names (empty when `value` says not to compile)."""
    options = compile_options(value)
    if options is None:
        return []
    names = compiled_methods(module)
    for name in names:
        bound = getattr(module, name)
        object.__setattr__(module, name, torch.compile(bound, **options))
    return names
