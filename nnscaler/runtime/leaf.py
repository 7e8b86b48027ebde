"""Opaque leaves at run time: a submodule or method the compiler could not trace runs eagerly, as one op.

Generated code calls `call(self, "model.visual", pixel_values, grid_thw=image_grid_thw)` where the
model called `self.visual(pixel_values, grid_thw=image_grid_thw)`, and
`call(self, "model.get_image_features()", pixel_values, image_grid_thw)` where it called the method
`self.model.get_image_features(...)` (`"scatter()"`: a method of the top module). A leaf method uses
the parameters and buffers its module's structure copy holds under the names the generated class lists
in `leaf_state` (those the method was seen to use; the others stay empty meta tensors). The generated module holds the
leaf's parameters and buffers under their original names (registered like any other weight, whole on
every rank: the plan replicates a leaf), and a copy of the leaf's structure (its code and
attributes, its tensors on the meta device), attached by `parallelize` from the user's model
(`attach_leaf_modules`). `call` runs that copy with `torch.func.functional_call` on the generated
module's tensors, so autograd gives them their gradients and the gradient reducer, optimizers and
checkpoints see nothing special.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["call", "attach_leaf_modules", "structure_copy"]

_ATTR = "_nnscaler_leaf_modules"


class _Method(torch.nn.Module):
    """A leaf method as a module's forward (`torch.func.functional_call` runs forwards): `owner.<name>`."""

    def __init__(self, owner: torch.nn.Module, name: str):
        super().__init__()
        self.owner = owner
        self.method = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # noqa: D102
        return getattr(self.owner, self.method)(*args, **kwargs)


def _split(key: str) -> tuple[str, str | None]:
    """(module path, method name) of a leaf key; (path, None) for a leaf module."""
    if not key.endswith("()"):
        return key, None
    owner, _, name = key[:-2].rpartition(".")
    return owner, name


def structure_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `module` whose parameters and buffers are empty meta tensors (no memory)."""
    memo: dict[int, Any] = {}
    for t in (*module.parameters(), *module.buffers()):
        empty = torch.empty_like(t, device="meta")
        memo[id(t)] = (
            torch.nn.Parameter(empty, t.requires_grad) if isinstance(t, torch.nn.Parameter) else empty
        )
    return copy.deepcopy(module, memo)


def attach_leaf_modules(target: torch.nn.Module | type, source: torch.nn.Module) -> None:
    """Give a generated module (or class) a structure copy of each leaf module it runs
    (`target.leaf_modules`, paths in `source`, the model given to parallelize). No leaves: nothing."""
    paths = getattr(target, "leaf_modules", ())
    if not paths:
        return
    copies = {}
    for path in paths:
        owner, method = _split(path)
        try:
            sub = source.get_submodule(owner) if owner else source
            if method is not None and not callable(getattr(sub, method, None)):
                raise AttributeError(method)
        except AttributeError:
            raise ValueError(
                f"the generated module runs {path!r} eagerly (an opaque leaf), but {type(source).__name__} has "
                "no such submodule or method: attach the model it was compiled from"
            ) from None
        copies[path] = structure_copy(sub) if method is None else _Method(structure_copy(sub), method)
    if isinstance(target, type):
        setattr(target, _ATTR, copies)
    else:
        target.__dict__[_ATTR] = copies  # a plain attribute: not a submodule, its tensors are not ours


def _state(owner: torch.nn.Module, path: str, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The leaf's parameters and buffers as the generated module holds them, by relative name."""
    local_of, aliases = owner._local_of, owner.aliases
    prefix, method = _split(path)
    if method is None:  # (name in the leaf module, original name)
        names = [(rel, f"{path}.{rel}") for rel, _ in (*module.named_parameters(), *module.named_buffers())]
    else:  # the state the method uses, by name in its module (the generated class lists it)
        used = getattr(owner, "leaf_state", {}).get(path, ())
        names = [(f"owner.{rel}", f"{prefix}.{rel}" if prefix else rel) for rel in used]
    state = {}
    for rel, original in names:
        local = local_of.get(original) or local_of.get(aliases.get(original, ""))
        if local is None:
            raise RuntimeError(
                f"{type(owner).__name__} holds no {original!r}, which the opaque leaf {path} needs: the "
                "module it was given is not the one compiled (regenerate with reuse='override')"
            )
        state[rel] = getattr(owner, local)
    return state


@torch.compiler.disable(reason="an opaque leaf module runs eagerly: its code could not be traced")
def call(owner: torch.nn.Module, path: str, /, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
    """Run leaf module (or method) `path` of `owner` on (args, kwargs); the tensors of its output, flattened.
    Eager under `ComputeConfig.torch_compile` too (one graph break per call): the leaf is one because
    its code is data-dependent, which dynamo would split and recompile for every new value."""
    modules = getattr(owner, _ATTR, None)
    if not modules or path not in modules:
        raise RuntimeError(
            f"{type(owner).__name__} runs {path!r} eagerly (an opaque leaf module) but has no copy of it: "
            "parallelize attaches it; a generated class built by hand needs "
            "nnscaler.runtime.leaf.attach_leaf_modules(module_or_class, model) first"
        )
    module = modules[path]
    if module.training != owner.training:
        module.train(owner.training)
    out = torch.func.functional_call(module, _state(owner, path, module), args, kwargs)
    return tuple(t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
