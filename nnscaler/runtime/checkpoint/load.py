"""Checkpoints of parallel modules: load merged (single-device) state dicts under any plan, save
and load deduped or sharded ones. Merging per-rank state dicts is in checkpoint_merge.

A merged model state dict is keyed by the original (single-device) names; a merged optimizer state
dict lists each param group's parameters by those names under `param_names`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from nnscaler.errors import CheckpointError
from nnscaler.runtime.checkpoint.broadcast import (
    broadcast_optimizer_state,
    broadcast_persistent_weights,
    broadcast_weights,
    dp_first,
    optimizer_state_first,
    share_zero3_weights,
)
from nnscaler.runtime.checkpoint.checks import metas_of, missing_metadata
from nnscaler.runtime.checkpoint.formats import OPTIMIZER_META_KEY, ZERO_SLICES_KEY
from nnscaler.runtime.checkpoint.keys import check_load_keys, module_keys
from nnscaler.runtime.checkpoint.merge import group_names as _group_names
from nnscaler.runtime.checkpoint.merge import merge_state_dicts
from nnscaler.runtime.module import ParallelModule
from nnscaler.runtime.optimizer import model_param_groups, optimizer_state_dict, parallel_modules, param_names
from nnscaler.runtime.shard import shard_slice

__all__ = [
    "merge_state_dicts",
    "load_merged_state_dict",
    "deduped_state_dict",
    "load_deduped_state_dict",
    "load_sharded_state_dict",
    "broadcast_weights",
]


def _full_names(module: nn.Module) -> dict[str, tuple[ParallelModule | None, Any]]:
    """Merged-state-dict name -> (owning ParallelModule or None, ShardInfo or the outer tensor)."""
    out: dict[str, tuple[ParallelModule | None, Any]] = {}
    for prefix, pm in parallel_modules(module):
        for info in pm.fullmap.values():
            out[prefix + info.original_name] = (pm, info)
    inner = {id(t) for _, pm in parallel_modules(module) for t in [*pm.parameters(), *pm.buffers()]}
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if id(t) not in inner:
            out.setdefault(name, (None, t))
    return out


def _model_param_groups(optimizer: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    """The module parameters of each param group (a ZeroOptimizer's wrapped one holds slices, a
    mixed-precision one fp32 masters)."""
    return model_param_groups(optimizer)


def _on_device(device: str | torch.device | None, *state_dicts: Mapping[str, Any] | None) -> tuple[Any, ...]:
    """nnScaler's `device=` of the loaders: the state dicts' tensors moved there first (None: as they are)."""
    if device is None:
        return state_dicts
    move = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
    return tuple(None if sd is None else torch.utils._pytree.tree_map(move, dict(sd)) for sd in state_dicts)


def load_merged_state_dict(
    module: nn.Module,
    module_state_dict: Mapping[str, Any],
    optimizer: torch.optim.Optimizer | None = None,
    optimizer_state_dict: Mapping[str, Any] | None = None,
    *,
    strict: bool = True,
    device: str | torch.device | None = None,
) -> _IncompatibleKeys:
    """Load single-device state dicts (e.g. from `merge_state_dicts`) into this rank's module/optimizer.

    Works under any plan: each rank takes its own shards. A merged optimizer state dict without
    `param_names` (a plain single-device optimizer's) is matched by position: parameter `i` is the
    `i`-th parameter entry of `module_state_dict` (its `named_parameters()` order).

    Returns the missing and unexpected keys of the model state dict, as torch's `load_state_dict`
    does. `strict` raises naming them before loading anything; `strict=False` loads the matching
    keys and warns about the others. A state dict of which no key matches raises either way (the
    wrong dict, or keys with an extra prefix such as 'module.'; the message says which).
    """
    module_state_dict, optimizer_state_dict = _on_device(device, module_state_dict, optimizer_state_dict)
    missing, unexpected = check_load_keys(module_keys(module), module_state_dict, strict)
    if isinstance(module, ParallelModule):
        module.load_merged_state_dict(module_state_dict, strict=False)
    else:
        for prefix, pm in parallel_modules(module):
            sub = {k[len(prefix) :]: v for k, v in module_state_dict.items() if k.startswith(prefix)}
            pm.load_merged_state_dict(sub, strict=False)
        with torch.no_grad():
            for k, (pm, t) in _full_names(module).items():
                if pm is None and k in module_state_dict:
                    t.copy_(module_state_dict[k])
    if optimizer is not None and optimizer_state_dict is not None:
        _load_merged_optimizer(module, module_state_dict, optimizer, optimizer_state_dict, strict)
    return _IncompatibleKeys(missing, unexpected)


def _merged_names(
    full: Mapping[str, tuple[ParallelModule | None, Any]],
    model_state_dict: Mapping[str, Any],
    optimizer_state_dict: Mapping[str, Any],
) -> list[str]:
    """The parameter name of each entry of a merged optimizer state dict, in order."""
    if all("param_names" in g for g in optimizer_state_dict["param_groups"]):
        return [n for g in _group_names(optimizer_state_dict) for n in g]
    is_param = {
        k for k, (pm, t) in full.items() if (t.is_param if pm is not None else isinstance(t, nn.Parameter))
    }
    merged_names = [k for k in model_state_dict if k in is_param]
    nparams = sum(len(g["params"]) for g in optimizer_state_dict["param_groups"])
    if len(merged_names) != nparams:  # a fine-tune's optimizer: over the trainable parameters only
        trainable = [k for k in merged_names if _requires_grad(*full[k])]
        if len(trainable) == nparams:
            return trainable
        raise CheckpointError(
            f"load_merged_state_dict: cannot match {nparams} optimizer entries to parameters by position "
            f"({len(merged_names)} known parameters in the model state dict, {len(trainable)} of them "
            "trainable); save with param_names"
        )
    return merged_names


def _requires_grad(pm: ParallelModule | None, t: Any) -> bool:
    """Whether a parameter of `_full_names` trains (a ParallelModule's by its registered tensor)."""
    return bool((pm._tensor(t.local_name) if pm is not None else t).requires_grad)


def _load_merged_optimizer(
    module: nn.Module,
    model_state_dict: Mapping[str, Any],
    optimizer: torch.optim.Optimizer,
    optimizer_state_dict: Mapping[str, Any],
    strict: bool,
) -> None:
    full = _full_names(module)
    position = {n: j for j, n in enumerate(_merged_names(full, model_state_dict, optimizer_state_dict))}
    names = param_names(module)
    groups = _model_param_groups(optimizer)
    saved_groups = optimizer_state_dict["param_groups"]
    if len(saved_groups) != len(groups):
        raise CheckpointError(
            f"load_merged_state_dict: the optimizer state dict has {len(saved_groups)} param groups, the "
            f"optimizer {len(groups)}; build the optimizer with the param groups it was saved with"
        )
    absent = [names[id(p)] for group in groups for p in group if names[id(p)] not in position]
    if absent:
        message = (
            f"load_merged_state_dict: the optimizer state dict has no entry for parameters "
            f"{absent[:20]}{' ...' if len(absent) > 20 else ''}"
        )
        if strict:
            raise CheckpointError(message + "; pass strict=False to start their states afresh")
        warnings.warn(message + "; their optimizer states start afresh", stacklevel=3)
    local: dict[str, Any] = {"state": {}, "param_groups": []}
    k = 0
    for g, group_params in enumerate(groups):
        saved = dict(saved_groups[g])
        saved.pop("param_names", None)
        saved.pop(ZERO_SLICES_KEY, None)
        saved["params"] = list(range(k, k + len(group_params)))
        local["param_groups"].append(saved)
        for p in group_params:
            name = names[id(p)]
            pm, info = full[name]
            merged_state = optimizer_state_dict["state"].get(position[name], {}) if name in position else {}
            shard = info.shard if pm is not None else None
            local["state"][k] = {
                s: shard_slice(v, shard).clone() if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                for s, v in merged_state.items()
            }
            if not local["state"][k]:
                del local["state"][k]
            k += 1
    optimizer.load_state_dict(local)


def deduped_state_dict(
    module: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Per-rank state dicts without duplicates: only the first rank of each data-parallel group keeps
    a ParallelModule's tensors (others keep its metadata); outer tensors stay on global rank 0 only.
    Under ZeRO every rank of the first ZeRO group of each data-parallel group keeps its optimizer slice."""
    sd = module.state_dict()
    drop: set[str] = set()
    drop_state: set[str] = set()
    for name, (pm, _) in _full_names(module).items():
        if not dp_first(pm):
            drop.add(name)
        if not optimizer_state_first(pm):
            drop_state.add(name)
    model_sd = {k: v for k, v in sd.items() if k not in drop}
    if optimizer is None:
        return model_sd, None
    opt_sd = optimizer_state_dict(module, optimizer)
    flat = [n for names in _group_names(opt_sd) for n in names]
    opt_sd["state"] = {i: s for i, s in opt_sd["state"].items() if flat[int(i)] not in drop_state}
    return model_sd, opt_sd


def load_deduped_state_dict(
    module: nn.Module,
    module_state_dict: Mapping[str, Any],
    optimizer: torch.optim.Optimizer | None = None,
    optimizer_state_dict: Mapping[str, Any] | None = None,
    *,
    device: str | torch.device | None = None,
) -> None:
    """Load `deduped_state_dict` output (same plan): load what this rank has, broadcast the rest."""
    module_state_dict, optimizer_state_dict = _on_device(device, module_state_dict, optimizer_state_dict)
    _check_metadata("load_deduped_state_dict", module, module_state_dict)
    module_state_dict = share_zero3_weights(module, module_state_dict)
    module.load_state_dict(module_state_dict, strict=False)
    broadcast_persistent_weights(module)  # non-persistent buffers: in no checkpoint, each rank keeps its own
    if optimizer is None or optimizer_state_dict is None:
        return
    _check_optimizer_rank("load_deduped_state_dict", module, optimizer_state_dict)
    flat = [n for names in _group_names(optimizer_state_dict) for n in names]
    by_name = {flat[int(i)]: s for i, s in optimizer_state_dict["state"].items()}
    by_name = broadcast_optimizer_state(module, by_name)
    names = param_names(module)
    local = dict(optimizer_state_dict)
    local["state"] = {}
    local_flat = [names[id(p)] for group in _model_param_groups(optimizer) for p in group]
    for i, name in enumerate(local_flat):
        if name in by_name:
            local["state"][i] = by_name[name]
    optimizer.load_state_dict(local)


def _check_metadata(who: str, module: nn.Module, model_state_dict: Mapping[str, Any]) -> None:
    """A rank's own state dict must carry the metadata of each ParallelModule (which rank, which plan)."""
    saved = metas_of(model_state_dict)
    for prefix, _ in parallel_modules(module):
        if prefix not in saved:
            where = f" of the ParallelModule at {prefix!r}" if prefix else ""
            raise missing_metadata(f"{who}: the model state dict{where}")


def _check_optimizer_rank(who: str, module: nn.Module, optimizer_state_dict: Mapping[str, Any]) -> None:
    """An optimizer state dict that records its rank and plans must be this rank's, under this plan."""
    meta = optimizer_state_dict.get(OPTIMIZER_META_KEY)
    if not isinstance(meta, dict):
        return
    for prefix, pm in parallel_modules(module):
        rank, plan = meta.get("rank"), meta.get("plans", {}).get(prefix, pm.plan_id)
        if rank != pm.rank or plan != pm.plan_id:
            raise CheckpointError(
                f"{who}: the optimizer state dict was saved by rank {rank} under plan {str(plan)[:12]}, but "
                f"this is rank {pm.rank} under plan {pm.plan_id[:12]}; load each rank's own optimizer state "
                "dict, or merge them (merge_state_dicts) and load with load_merged_state_dict"
            )


def load_sharded_state_dict(
    module: nn.Module,
    module_state_dict: Mapping[str, Any],
    optimizer: torch.optim.Optimizer | None = None,
    optimizer_state_dict: Mapping[str, Any] | None = None,
    *,
    device: str | torch.device | None = None,
) -> None:
    """Load this rank's own state dicts, saved under the same plan (a plain `load_state_dict`, after
    checking that they carry their metadata and come from this rank and plan)."""
    module_state_dict, optimizer_state_dict = _on_device(device, module_state_dict, optimizer_state_dict)
    _check_metadata("load_sharded_state_dict", module, module_state_dict)
    if optimizer is not None and optimizer_state_dict is not None:
        _check_optimizer_rank("load_sharded_state_dict", module, optimizer_state_dict)
    module.load_state_dict(module_state_dict)
    if optimizer is not None and optimizer_state_dict is not None:
        optimizer.load_state_dict(optimizer_state_dict)
