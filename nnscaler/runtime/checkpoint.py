"""Checkpoints of parallel modules: merge per-rank state dicts into single-device ones and back.

A model state dict of a rank is `module.state_dict()`: ParallelModule tensors under their original
names (this rank's pieces) plus each ParallelModule's `_extra_state` (the sharding metadata).
An optimizer state dict of a rank is `optimizer.state_dict()` of an optimizer from `build_optimizer`
(or `optimizer_state_dict(module, optimizer)`): each param group lists the merged names of its
parameters under `param_names`, which is how pieces are matched across ranks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from nnscaler.runtime.checkpoint_dist import (
    broadcast_optimizer_state,
    broadcast_weights,
    dp_first,
    optimizer_state_first,
    share_zero3_weights,
)
from nnscaler.runtime.module import EXTRA_STATE_FORMAT, EXTRA_STATE_KEY, ParallelModule
from nnscaler.runtime.optimizer import model_param_groups, optimizer_state_dict, parallel_modules, param_names
from nnscaler.runtime.shard import assemble_shards, local_shape, shard_slice
from nnscaler.runtime.zero import ZERO_SLICES_KEY

__all__ = [
    "merge_state_dicts",
    "load_merged_state_dict",
    "deduped_state_dict",
    "load_deduped_state_dict",
    "load_sharded_state_dict",
    "broadcast_weights",
]

Meta = dict[str, Any]


def _metas(sd: Mapping[str, Any]) -> dict[str, Meta]:
    """Prefix -> extra state of every ParallelModule in a rank's model state dict."""
    return {
        k[: -len(EXTRA_STATE_KEY)]: v
        for k, v in sd.items()
        if k.endswith(EXTRA_STATE_KEY) and isinstance(v, dict) and v.get("format") == EXTRA_STATE_FORMAT
    }


def _shard_map(metas: Mapping[str, Meta]) -> dict[str, Meta]:
    """Full key -> fullmap entry of every tensor of the ParallelModules."""
    return {prefix + name: m for prefix, meta in metas.items() for name, m in meta["fullmap"].items()}


def _layout(m: Meta) -> tuple[int, int, int]:
    dim, _, ways, blocks = m["shard"]
    return dim, ways, blocks


def _assemble(key: str, pieces: dict[int, torch.Tensor], m: Meta) -> torch.Tensor:
    dim, _, ways, blocks = m["shard"]
    try:
        return assemble_shards(pieces, m["full_shape"], dim, ways, blocks)
    except ValueError as err:
        raise ValueError(
            f"merge_state_dicts: {key}: {err}; pass the state dicts of every rank of one data-parallel replica"
        ) from None


def merge_state_dicts(
    model_state_dicts: Sequence[Mapping[str, Any]],
    optimizer_state_dicts: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Rebuild the single-device model (and optimizer) state dicts from per-rank ones.

    Give the state dicts of all ranks of at least one data-parallel replica (any order; extra ranks
    are fine). `optimizer_state_dicts[i]` must belong to the rank of `model_state_dicts[i]`. Tied
    weights appear under every name. Optimizer states whose tensors have the parameter's shape
    (SGD momentum, Adam, AdamW, ...) are merged; scalar states (`step`) are copied. The fp32 master
    weights of the mixed-precision optimizers are such a state (`"fp32_params"`, MASTER_KEY of
    nnscaler.runtime.mixed_precision): `merged_optimizer["state"][i]["fp32_params"]` is parameter i's.

    Parameter order of the merged optimizer state: group by group, each parameter in the order the
    ranks list it (ranks ascending), i.e. the order in which the generated module registers them with
    `add_shard`. That is the single-device optimizer's order over `original_model.parameters()` when
    the generated code registers parameters in the original `state_dict()` order (the compiler's
    contract); each merged group also carries `param_names`, and `load_merged_state_dict` uses those
    names, so loading back is exact even when the order differs.
    """
    order = sorted(
        range(len(model_state_dicts)),
        key=lambda i: min([m["rank"] for m in _metas(model_state_dicts[i]).values()] or [i]),
    )
    merged: dict[str, Any] = {}
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    specs: dict[str, Meta] = {}
    aliases: dict[str, str] = {}
    for i in order:
        sd, metas = model_state_dicts[i], _metas(model_state_dicts[i])
        shards = _shard_map(metas)
        aliases.update({p + a: p + o for p, meta in metas.items() for a, o in meta["aliases"].items()})
        for key, value in sd.items():
            if key.endswith(EXTRA_STATE_KEY) and key[: -len(EXTRA_STATE_KEY)] in metas:
                continue
            m = shards.get(key)
            if m is None or m["shard"] is None:
                merged.setdefault(key, value)
                continue
            spec = specs.setdefault(key, m)
            if spec["full_shape"] != m["full_shape"] or _layout(spec) != _layout(m):
                raise ValueError(f"merge_state_dicts: ranks disagree on the full shape or sharding of {key}")
            merged.setdefault(key, None)
            pieces.setdefault(key, {})[m["shard"][1]] = value
    for key, parts in pieces.items():
        merged[key] = _assemble(key, parts, specs[key])
    for alias, original in aliases.items():
        if original in merged:
            merged[alias] = merged[original]
    if optimizer_state_dicts is None:
        return merged, None
    if len(optimizer_state_dicts) != len(model_state_dicts):
        raise ValueError("merge_state_dicts: give one optimizer state dict per model state dict")
    ranks = [(optimizer_state_dicts[i], _shard_map(_metas(model_state_dicts[i]))) for i in order]
    return merged, _merge_optimizer(_join_zero_slices(ranks))


def _group_names(opt_sd: Mapping[str, Any]) -> list[list[str]]:
    groups = opt_sd["param_groups"]
    if any("param_names" not in g for g in groups):
        raise ValueError(
            "optimizer state dict has no param_names: build the optimizer with build_optimizer or save it "
            "with nnscaler.runtime.optimizer.optimizer_state_dict(module, optimizer)"
        )
    return [list(g["param_names"]) for g in groups]


def _join_zero_slices(
    ranks: Sequence[tuple[Mapping[str, Any], dict[str, Meta]]],
) -> list[tuple[Mapping[str, Any], dict[str, Meta]]]:
    """ZeRO optimizer state dicts hold slices of each flattened local tensor (param group key
    `zero_slices`); join the slices of all ranks so each rank's state holds whole local tensors."""
    if not any(ZERO_SLICES_KEY in g for opt, _ in ranks for g in opt["param_groups"]):
        return list(ranks)
    pieces: dict[tuple[str, Any, str], dict[int, tuple[int, torch.Tensor]]] = {}
    scalars: dict[tuple[str, Any], dict[str, Any]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    listed = []
    for opt, shards in ranks:
        names = [n for group in _group_names(opt) for n in group]
        slices = [s for g in opt["param_groups"] for s in g.get(ZERO_SLICES_KEY, [None] * len(g["params"]))]
        keys = []
        for name, sl in zip(names, slices):
            m = shards.get(name)
            if sl is None or m is None:
                keys.append(None)
                continue
            shapes[name] = local_shape(m["full_shape"], m["shard"])
            keys.append((name, None if m["shard"] is None else m["shard"][1]))
        listed.append(keys)
        for idx, state in opt["state"].items():
            key, sl = keys[int(idx)], slices[int(idx)]
            if key is None:
                continue
            for skey, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    pieces.setdefault((*key, skey), {})[sl[0]] = (sl[1], value)
                else:
                    scalars.setdefault(key, {}).setdefault(skey, value)
    joined: dict[tuple[str, Any], dict[str, Any]] = {k: dict(v) for k, v in scalars.items()}
    for (name, index, skey), parts in pieces.items():
        numel, at, chunks = math.prod(shapes[name]), 0, []
        for start in sorted(parts):
            end, value = parts[start]
            if start != at:
                break
            chunks.append(value.reshape(-1))
            at = end
        if at != numel:
            raise ValueError(
                f"merge_state_dicts: optimizer state {skey!r} of {name} lacks ZeRO slices from element {at} "
                f"of {numel}; pass the state dicts of every rank of a ZeRO group"
            )
        joined.setdefault((name, index), {})[skey] = torch.cat(chunks).view(shapes[name])
    out = []
    for (opt, shards), keys in zip(ranks, listed):
        state = {i: s for i, s in opt["state"].items() if keys[int(i)] is None}
        state.update({i: joined[k] for i, k in enumerate(keys) if k is not None and k in joined})
        groups = [{k: v for k, v in g.items() if k != ZERO_SLICES_KEY} for g in opt["param_groups"]]
        out.append(({"state": state, "param_groups": groups}, shards))
    return out


def _merge_optimizer(ranks: Sequence[tuple[Mapping[str, Any], dict[str, Meta]]]) -> dict[str, Any]:
    ngroups = {len(opt["param_groups"]) for opt, _ in ranks}
    if len(ngroups) != 1:
        raise ValueError(
            f"merge_state_dicts: ranks' optimizers have different numbers of param groups {ngroups}"
        )
    group_names: list[list[str]] = [[] for _ in range(ngroups.pop())]
    for opt, _ in ranks:
        for merged_names, names in zip(group_names, _group_names(opt)):
            merged_names.extend(n for n in names if n not in merged_names)
    index = {n: j for j, n in enumerate(n for names in group_names for n in names)}
    state: dict[int, dict[str, Any]] = {}
    pieces: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    specs: dict[int, Meta] = {}
    for opt, shards in ranks:
        flat = [n for names in _group_names(opt) for n in names]
        for local_idx, local_state in opt["state"].items():
            name = flat[int(local_idx)]
            j, m = index[name], shards.get(name)
            entry = state.setdefault(j, {})
            for skey, value in local_state.items():
                sharded = m is not None and m["shard"] is not None
                if not (sharded and isinstance(value, torch.Tensor) and value.dim() > 0):
                    entry.setdefault(skey, value)
                    continue
                dim, _, ways, _ = m["shard"]
                want = list(m["full_shape"])
                want[dim] //= ways
                if list(value.shape) != want:
                    raise NotImplementedError(
                        f"merge_state_dicts: optimizer state {skey!r} of {name} has shape {list(value.shape)}, "
                        f"not the parameter's local shape {want}; only per-element states can be merged"
                    )
                entry.setdefault(skey, None)
                specs[j] = m
                pieces.setdefault((j, skey), {})[m["shard"][1]] = value
    for (j, skey), parts in pieces.items():
        state[j][skey] = _assemble(f"optimizer state {skey!r} of parameter {j}", parts, specs[j])
    param_groups = []
    for g, names in enumerate(group_names):
        base = next(dict(opt["param_groups"][g]) for opt, _ in ranks)
        base["params"] = [index[n] for n in names]
        base["param_names"] = list(names)
        param_groups.append(base)
    return {"state": dict(sorted(state.items())), "param_groups": param_groups}


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


def load_merged_state_dict(
    module: nn.Module,
    model_state_dict: Mapping[str, Any],
    optimizer: torch.optim.Optimizer | None = None,
    optimizer_state_dict: Mapping[str, Any] | None = None,
    *,
    strict: bool = True,
) -> None:
    """Load single-device state dicts (e.g. from `merge_state_dicts`) into this rank's module/optimizer.

    Works under any plan: each rank takes its own shards. A merged optimizer state dict without
    `param_names` (a plain single-device optimizer's) is matched by position: parameter `i` is the
    `i`-th parameter entry of `model_state_dict` (its `named_parameters()` order).
    """
    if isinstance(module, ParallelModule):
        module.load_merged_state_dict(model_state_dict, strict=strict)
    else:
        for prefix, pm in parallel_modules(module):
            sub = {k[len(prefix) :]: v for k, v in model_state_dict.items() if k.startswith(prefix)}
            pm.load_merged_state_dict(sub, strict=strict)
        outer = {k: t for k, (pm, t) in _full_names(module).items() if pm is None}
        missing = [k for k in outer if k not in model_state_dict]
        if strict and missing:
            raise RuntimeError(f"load_merged_state_dict: missing keys {missing}")
        with torch.no_grad():
            for k, t in outer.items():
                if k in model_state_dict:
                    t.copy_(model_state_dict[k])
    if optimizer is None or optimizer_state_dict is None:
        return
    full = _full_names(module)
    if all("param_names" in g for g in optimizer_state_dict["param_groups"]):
        merged_names = [n for g in _group_names(optimizer_state_dict) for n in g]
    else:
        is_param = {
            k
            for k, (pm, t) in full.items()
            if (t.is_param if pm is not None else isinstance(t, nn.Parameter))
        }
        merged_names = [k for k in model_state_dict if k in is_param]
        nparams = sum(len(g["params"]) for g in optimizer_state_dict["param_groups"])
        if len(merged_names) != nparams:
            raise ValueError(
                f"load_merged_state_dict: cannot match {nparams} optimizer entries to parameters by position "
                f"({len(merged_names)} known parameters in the model state dict); save with param_names"
            )
    position = {n: j for j, n in enumerate(merged_names)}
    names = param_names(module)
    local: dict[str, Any] = {"state": {}, "param_groups": []}
    k = 0
    for g, group_params in enumerate(_model_param_groups(optimizer)):
        saved = dict(optimizer_state_dict["param_groups"][g])
        saved.pop("param_names", None)
        saved.pop(ZERO_SLICES_KEY, None)
        saved["params"] = list(range(k, k + len(group_params)))
        local["param_groups"].append(saved)
        for p in group_params:
            name = names[id(p)]
            pm, info = full[name]
            merged_state = optimizer_state_dict["state"].get(position[name], {})
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
    model_state_dict: Mapping[str, Any],
    optimizer: torch.optim.Optimizer | None = None,
    optimizer_state_dict: Mapping[str, Any] | None = None,
) -> None:
    """Load `deduped_state_dict` output (same plan): load what this rank has, broadcast the rest."""
    model_state_dict = share_zero3_weights(module, model_state_dict)
    module.load_state_dict(model_state_dict, strict=False)
    broadcast_weights(module)
    if optimizer is None or optimizer_state_dict is None:
        return
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


def load_sharded_state_dict(
    module: nn.Module,
    model_state_dict: Mapping[str, Any],
    optimizer: torch.optim.Optimizer | None = None,
    optimizer_state_dict: Mapping[str, Any] | None = None,
) -> None:
    """Load this rank's own state dicts, saved under the same plan (a plain `load_state_dict`)."""
    module.load_state_dict(model_state_dict)
    if optimizer is not None and optimizer_state_dict is not None:
        optimizer.load_state_dict(optimizer_state_dict)
