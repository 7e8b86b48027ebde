"""build_optimizer: an optimizer whose step first synchronizes gradients across data-parallel replicas."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nnscaler.config import ComputeConfig
from nnscaler.errors import ConfigError
from nnscaler.runtime.checkpoint.formats import OPTIMIZER_META_KEY
from nnscaler.runtime.checkpoint.piece_meta import optimizer_meta
from nnscaler.runtime.device import is_initialized, runtime_device
from nnscaler.runtime.grads.mixed_precision import MixedPrecisionOptimizer, find_mixed_precision
from nnscaler.runtime.grads.reducer import average_gradients, grad_sq_norm, scale_grads
from nnscaler.runtime.grads.reducer_hooks import OuterReducer, add_reducer_hook_methods
from nnscaler.runtime.grads.zero import ZeroOptimizer
from nnscaler.runtime.module import ParallelModule

__all__ = [
    "build_optimizer",
    "attach_optimizer",
    "parallel_modules",
    "param_names",
    "outer_parameters",
    "sync_grads",
    "clip_gnorm",
    "optimizer_state_dict",
    "model_param_groups",
]


def parallel_modules(module: nn.Module) -> list[tuple[str, ParallelModule]]:
    """`(state-dict prefix, module)` for `module` itself or each ParallelModule inside it."""
    return [(f"{n}." if n else "", m) for n, m in module.named_modules() if isinstance(m, ParallelModule)]


def param_names(module: nn.Module) -> dict[int, str]:
    """`id(parameter)` -> its name in the merged (single-device) state dict."""
    names: dict[int, str] = {}
    for prefix, pm in parallel_modules(module):
        for local, info in pm.fullmap.items():
            if info.is_param:
                names[id(pm._tensor(local))] = prefix + info.original_name
    for name, p in module.named_parameters():
        names.setdefault(id(p), name)
    return names


def outer_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Parameters of `module` that live outside every ParallelModule (replicated on all ranks)."""
    inner = {id(p) for _, pm in parallel_modules(module) for p in pm.parameters()}
    return [p for p in module.parameters() if id(p) not in inner]


def _reducers(module: nn.Module) -> list[Any]:
    """The gradient reducers of every ParallelModule in `module` (nnScaler's `reducers`), each labelled
    with its module's class and path (for its warnings)."""
    out = []
    for prefix, pm in parallel_modules(module):
        for r in pm.reducers:
            r.label = f"{type(pm).__name__} at {prefix.rstrip('.') or '<root>'!r}"
            out.append(r)
    return out


def _world() -> dist.ProcessGroup | None:
    return dist.group.WORLD if is_initialized() and dist.get_world_size() > 1 else None


def sync_grads(module: nn.Module) -> None:
    """Sync gradients of every ParallelModule not yet synced, and average outer gradients over the world."""
    for _, pm in parallel_modules(module):
        if not pm._grads_synced:
            pm.sync_grad()
    average_gradients(outer_parameters(module), _world())


def clip_gnorm(
    module: nn.Module, max_norm: float | None = None, average_outer: Callable[[], None] | None = None
) -> torch.Tensor:
    """Total gradient 2-norm of `module` (ParallelModules and outer parameters) as a 0-dim device
    tensor (no host sync); clip in place if asked."""
    if isinstance(module, ParallelModule):
        return module.total_gnorm(max_norm)
    pms = parallel_modules(module)
    outer = outer_parameters(module)
    if average_outer is None:
        average_gradients(outer, _world())
    else:  # the optimizer's OuterReducer (its hooks)
        average_outer()
    total = grad_sq_norm(outer, device=runtime_device())
    for _, pm in pms:
        total = total + pm.grad_sq_norm().to(total.device)
    total = total.sqrt()
    if max_norm is not None:
        scale_grads(outer, max_norm, total)
        for _, pm in pms:
            pm.scale_grads(max_norm, total)
    return total


def model_param_groups(optimizer: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    """The module parameters of each param group, in state-dict order (a ZeroOptimizer's wrapped
    optimizer holds slices of them, a mixed-precision one fp32 masters)."""
    if isinstance(optimizer, ZeroOptimizer):
        return [list(optimizer.params)]
    if isinstance(optimizer, MixedPrecisionOptimizer):
        return optimizer.model_param_groups()
    return [list(g["params"]) for g in optimizer.param_groups]


def _add_param_names(module: nn.Module, opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
    names = param_names(module)
    for saved, params in zip(sd["param_groups"], model_param_groups(opt)):
        saved["param_names"] = [names.get(id(p), f"<unnamed {i}>") for i, p in enumerate(params)]
    sd[OPTIMIZER_META_KEY] = optimizer_meta(module)  # rank and plan: merge pairs it with its model piece
    return sd


def _check_fp32_grads(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """`reduce_grads_in_fp32` leaves the reduced gradients of bf16 / fp16 parameters in `.main_grad`:
    the optimizer must read them there."""
    for _, pm in parallel_modules(module):
        if not getattr(pm.compute_config, "reduce_grads_in_fp32", False):
            continue
        low = [p for p in pm.parameters_for_optimizer() if p.requires_grad and p.element_size() < 4]
        inner = getattr(optimizer, "inner", optimizer)
        if low and not getattr(inner, "reads_main_grad", False):
            raise ConfigError(
                f"ComputeConfig.reduce_grads_in_fp32=True keeps the reduced gradients of "
                f"{type(pm).__name__}'s {low[0].dtype} parameters in fp32 `param.main_grad`, which "
                f"{type(inner).__name__} does not read: use nnscaler.runtime.MixedPrecisionAdam / "
                "MixedPrecisionAdamW (or set reduce_grads_in_fp32=False)"
            )


def optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`optimizer.state_dict()` with each param group's `param_names` set to merged state-dict names."""
    if isinstance(optimizer, ZeroOptimizer):
        return optimizer.state_dict()  # names its parameters itself
    return _add_param_names(module, optimizer, optimizer.state_dict())


def build_optimizer(
    module: nn.Module,
    optimizer_fn: Callable[..., torch.optim.Optimizer],
    compute_config: ComputeConfig | None = None,
    **kwargs: Any,
) -> torch.optim.Optimizer:
    """`optimizer_fn(params, **kwargs)` over the module's parameters, syncing gradients before each step.

    `compute_config` (nnScaler's argument, for modules parallelized without one): when given, every
    ParallelModule in `module` must run under it (its reducer is built from it); a mismatch raises.

    `module` is a ParallelModule or an nn.Module containing ParallelModules; parameters outside them
    are averaged over all ranks. Only trainable parameters (`requires_grad`) are given to the
    optimizer: frozen ones (fine-tuning, LoRA) get no gradient and no optimizer state, and keep their
    values; a rank holding none (a frozen pipeline stage) gets an optimizer over one empty param group.
    The optimizer's `state_dict()` names each parameter (param group key `param_names`, merged
    state-dict names) so `merge_state_dicts` can rebuild the full state.
    `optimizer.clip_gnorm(max_norm=None)` clips over the whole module; `optimizer.sync_shard_grad()`
    (nnScaler's name) finishes the parallel modules' gradient reductions now and, under ZeRO, points
    the optimizer's slices' `.grad` at their reduced gradients (the step would do both).

    When a ParallelModule runs with ZeRO (`ComputeConfig.use_zero`), the result is a
    `nnscaler.runtime.grads.zero.ZeroOptimizer`: `optimizer_fn` then gets this rank's slices of the
    parameters (1-D views), so it must be a per-element optimizer with one param group.

    With a mixed-precision optimizer (`MixedPrecisionAdam(W)`, nnscaler.runtime.grads.mixed_precision)
    `clip_gnorm` reports the norm of the unscaled gradients and defers the clipping to the step's
    fp32 cast (nothing is scaled in bf16 / fp16).
    """
    for prefix, pm in parallel_modules(module) if compute_config is not None else []:
        if pm.compute_config is None:
            pm.compute_config = compute_config
        elif pm.compute_config != compute_config:
            raise ValueError(
                f"build_optimizer(compute_config=...): the ParallelModule at {prefix or '<root>'!r} was "
                f"parallelized with {pm.compute_config}, not {compute_config}; leave compute_config out"
            )
    if isinstance(module, ParallelModule):
        params: list[nn.Parameter] = module.parameters_for_optimizer()
    else:
        params = [p for p in module.parameters() if p.requires_grad]
    built: list[torch.optim.Optimizer] = []
    sync, clip, outer = _step_hooks(module, built)
    if any(pm.reducer is not None and pm.reducer.zero for _, pm in parallel_modules(module)):
        zero = ZeroOptimizer(module, params, optimizer_fn, sync, clip, lambda: param_names(module), **kwargs)
        zero.sync_shard_grad = _zero_sync_shard_grad(module, zero)  # type: ignore[attr-defined]
        _check_fp32_grads(module, zero)
        built.append(zero)
        _reducer_hooks(zero, module, outer)
        return zero
    # a rank holding no trainable parameter (a frozen pipeline stage): one empty param group, so the
    # optimizer exists like on the other ranks and its state dict merges with theirs
    given: list[Any] = list(params) if params else [{"params": []}]
    return _attach(module, optimizer_fn(given, **kwargs), built, sync, clip, outer)


def attach_optimizer(module: nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Give an optimizer built elsewhere over `module`'s parameters (e.g. by a LightningModule's
    configure_optimizers) what build_optimizer gives its own: gradients synced before each step,
    parameter names in its state dict (for merge_state_dicts), `optimizer.clip_gnorm`. Not with ZeRO,
    whose optimizer must be built on the parameters' slices (use build_optimizer)."""
    if any(pm.reducer is not None and pm.reducer.zero for _, pm in parallel_modules(module)):
        raise ConfigError(
            "attach_optimizer: the module runs with ZeRO (ComputeConfig.use_zero), whose optimizer works on "
            "slices of the parameters; build it with nnscaler.build_optimizer(module, OptimizerClass, ...)"
        )
    built: list[torch.optim.Optimizer] = []
    sync, clip, outer = _step_hooks(module, built)
    return _attach(module, optimizer, built, sync, clip, outer)


def _sync_parallel_grads(module: nn.Module) -> None:
    """Finish the gradient reduction of every ParallelModule in `module` not yet synced."""
    for _, pm in parallel_modules(module):
        if not pm._grads_synced:
            pm.sync_grad()


def _zero_sync_shard_grad(module: nn.Module, zero: ZeroOptimizer) -> Callable[[], None]:
    def sync_shard_grad() -> None:
        _sync_parallel_grads(module)
        zero._attach_grads()  # the slices' .grad: views of the reduced buckets (clipping reaches them)

    return sync_shard_grad


def _step_hooks(module: nn.Module, built: list[torch.optim.Optimizer]):
    """(sync, clip, outer reducer or None) for the optimizer that will be appended to `built`."""
    outer = outer_parameters(module)
    outer_reducer = OuterReducer(outer, _world()) if any(p.requires_grad for p in outer) else None
    reduce_outer = outer_reducer.reduce if outer_reducer is not None else (lambda: None)
    synced = {"outer": False}

    def sync() -> None:
        _sync_parallel_grads(module)
        if not synced["outer"]:
            reduce_outer()
        synced["outer"] = False

    def clip(max_norm: float | None = None) -> torch.Tensor:
        mp = find_mixed_precision(built[0]) if built else None
        if mp is None:
            norm = clip_gnorm(module, max_norm, reduce_outer)
        else:  # the gradients are still scaled by the loss scale; clipping happens at the fp32 cast
            norm = clip_gnorm(module, None, reduce_outer) * mp.grad_multiplier
            if max_norm is not None:  # a device tensor: no host sync
                mp.multiply_grads(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        synced["outer"] = True
        return norm

    return sync, clip, outer_reducer


def _reducer_hooks(optimizer: torch.optim.Optimizer, module: nn.Module, outer: OuterReducer | None) -> None:
    """nnScaler's reducer hooks over every reducer, and its name for the outer parameters' reducer."""
    optimizer._non_parallel_module_reducer = outer  # type: ignore[attr-defined]
    add_reducer_hook_methods(optimizer, lambda: _reducers(module) + ([outer] if outer is not None else []))


def _attach(module, optimizer, built, sync, clip, outer) -> torch.optim.Optimizer:
    _check_fp32_grads(module, optimizer)
    built.append(optimizer)

    def add_names(opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
        return _add_param_names(module, opt, sd)

    optimizer.register_step_pre_hook(lambda opt, args, kw: sync())
    optimizer.register_state_dict_post_hook(add_names)
    optimizer.clip_gnorm = clip  # type: ignore[attr-defined]
    optimizer.sync_shard_grad = lambda: _sync_parallel_grads(module)  # type: ignore[attr-defined]
    _reducer_hooks(optimizer, module, outer)
    return optimizer
