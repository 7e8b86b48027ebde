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

import copy
import re
from typing import Any

import torch

__all__ = ["STAGE_METHOD", "CompiledMethod", "compile_options", "compiled_methods", "compile_generated"]

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


class CompiledMethod:
    """`torch.compile` of the generated class's method `name`, bound to `module`: installed as the
    instance attribute of that name.

    An object holding its module, not the compiled function itself: that function closes over the
    method bound to this instance, and `copy.deepcopy` (functions are atomic to it) would give a copy
    whose forward runs the original's weights, while `pickle` cannot save it at all. Copied or
    unpickled, it compiles again for the module it now belongs to (dynamo's cache is per function)."""

    def __init__(self, module: torch.nn.Module, name: str, options: dict[str, Any]):
        self.module = module
        self.name = name
        self.options = options
        self._compiled: Any = None

    @property
    def __wrapped__(self) -> Any:
        """The generated method bound to the module (not this attribute): `inspect.signature` reads it."""
        return getattr(type(self.module), self.name).__get__(self.module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._compiled is None:
            self._compiled = torch.compile(self.__wrapped__, **self.options)
        return self._compiled(*args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        return {"module": self.module, "name": self.name, "options": self.options, "_compiled": None}

    def __deepcopy__(self, memo: dict[int, Any]) -> CompiledMethod:
        return CompiledMethod(copy.deepcopy(self.module, memo), self.name, copy.deepcopy(self.options, memo))

    def __repr__(self) -> str:
        return f"CompiledMethod({type(self.module).__name__}.{self.name}, {self.options})"


def compile_generated(module: torch.nn.Module, value: bool | dict[str, Any] | None) -> list[str]:
    """Replace this instance's `forward` / `stage{k}` by their `torch.compile`d versions (compiled
    lazily, on the first call; `CompiledMethod`). Returns the wrapped names (empty when `value` says
    not to compile)."""
    options = compile_options(value)
    if options is None:
        return []
    names = compiled_methods(module)
    for name in names:
        object.__setattr__(module, name, CompiledMethod(module, name, options))
    return names
