"""Broadcasts used by the checkpoint helpers: weights and optimizer state within data-parallel groups."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from nnscaler.runtime.comm import rank_in_group
from nnscaler.runtime.device import is_initialized, runtime_device
from nnscaler.runtime.module import ParallelModule
from nnscaler.runtime.module_parts.buffers_init import NOT_INITED
from nnscaler.runtime.optimizer import parallel_modules

__all__ = [
    "broadcast_weights",
    "broadcast_persistent_weights",
    "broadcast_optimizer_state",
    "dp_first",
    "optimizer_state_first",
    "share_zero3_weights",
]


def _world() -> dist.ProcessGroup | None:
    return dist.group.WORLD if is_initialized() and dist.get_world_size() > 1 else None


def dp_first(pm: ParallelModule | None) -> bool:
    """Whether this rank keeps the tensors of `pm` in a deduped checkpoint (outer tensors: `pm` None)."""
    if pm is None:
        return not is_initialized() or dist.get_rank() == 0
    return rank_in_group(pm.group("dp")) == 0


def _optimizer_state_group(pm: ParallelModule) -> dist.ProcessGroup | None:
    """The ranks holding copies of `pm`'s optimizer states: "dp", or under ZeRO the cross group (same
    slice in every ZeRO group)."""
    red = pm._reducer
    if red is not None and red.zero:
        return red.cross_group
    return pm.group("dp")


def optimizer_state_first(pm: ParallelModule | None) -> bool:
    """Whether this rank keeps the optimizer states of `pm` in a deduped checkpoint."""
    if pm is None:
        return dp_first(None)
    return rank_in_group(_optimizer_state_group(pm)) == 0


def _broadcast_coalesced(tensors: Sequence[torch.Tensor], src: int, group: dist.ProcessGroup) -> None:
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for same in by_kind.values():
            flat = _flatten_dense_tensors([t.detach() for t in same])
            dist.broadcast(flat, src=src, group=group)
            for t, value in zip(same, _unflatten_dense_tensors(flat, same)):
                t.copy_(value)


def _outer_tensors(module: nn.Module) -> list[torch.Tensor]:
    inner = {id(t) for _, pm in parallel_modules(module) for t in [*pm.parameters(), *pm.buffers()]}
    return [t for t in [*module.parameters(), *module.buffers()] if id(t) not in inner]


def _check_source_buffers(pm: ParallelModule, prefix: str, src: int, dp: dist.ProcessGroup) -> None:
    """RuntimeError on every rank of `dp` when the source holds uninitialised non-persistent buffers
    (broadcasting them would spread garbage). The buffers are the same on every rank of one plan, so
    the ranks agree on whether to exchange the flag."""
    names = [i.original_name for i in pm.fullmap.values() if not i.is_param and not i.persistent]
    if not names:
        return
    flag = torch.tensor([int(pm.non_presistent_buffers_inited)], dtype=torch.int64, device=runtime_device())
    dist.broadcast(flag, src=src, group=dp)
    if not int(flag.item()):
        raise RuntimeError(
            f"{NOT_INITED} broadcast_weights: the source rank {src} of the ParallelModule at "
            f"{prefix or '<root>'!r} has not initialized its non-persistent buffers (of {names}), so there is "
            f"nothing valid to broadcast. Build it with init_module_params=True on rank {src}, or set the "
            "buffers there and call module.mark_non_persistent_buffers_inited() before broadcast_weights."
        )


def broadcast_weights(module: nn.Module, stride_size: int | None = None, *, src_rank: int = 0) -> None:
    """Make data-parallel replicas equal: broadcast each ParallelModule's local tensors within its
    "dp" group from the group's `src_rank`-th rank (0: the first); outer tensors from global `src_rank`.

    `stride_size` (nnScaler's argument): the ranks holding distinct pieces, sources of the broadcast;
    for a ParallelModule that is its `plan_ngpus` (the default, None), the only value that fits.
    RuntimeError on every rank when the source has uninitialised non-persistent buffers; afterwards
    every rank's are the source's (`non_presistent_buffers_inited` is True)."""
    _broadcast(module, stride_size, src_rank, non_persistent=True)


def broadcast_persistent_weights(module: nn.Module) -> None:
    """`broadcast_weights` without the non-persistent buffers (load_deduped_state_dict): no checkpoint
    holds them, so each rank keeps its own, initialised or not (forward refuses until they are)."""
    _broadcast(module, None, 0, non_persistent=False)


def _broadcast(module: nn.Module, stride_size: int | None, src_rank: int, *, non_persistent: bool) -> None:
    for prefix, pm in parallel_modules(module):
        if stride_size is not None and stride_size != pm.plan_ngpus:
            raise ValueError(
                f"broadcast_weights(stride_size={stride_size}): the ParallelModule at {prefix or '<root>'!r} "
                f"spans plan_ngpus={pm.plan_ngpus} ranks per replica, so weights can only be broadcast from one "
                f"replica's {pm.plan_ngpus} ranks: pass stride_size={pm.plan_ngpus} or None"
            )
        dp = pm.group("dp")
        if dp is None:
            continue
        src = dist.get_global_rank(dp, src_rank)
        if non_persistent:
            _check_source_buffers(pm, prefix, src, dp)
            skip: set[int] = set()
        else:
            skip = {id(pm._tensor(n)) for n, i in pm.fullmap.items() if not i.is_param and not i.persistent}
        buffers = [b for b in pm.buffers() if id(b) not in skip]
        if pm._zero3 is not None:  # ZeRO-3: parameters are slices; gather, broadcast, re-slice
            pm._zero3.broadcast(src)
            _broadcast_coalesced(buffers, src, dp)
        else:
            _broadcast_coalesced([*pm.parameters(), *buffers], src, dp)
        if non_persistent:
            pm.mark_non_persistent_buffers_inited()  # the source's, checked above
    world = _world()
    outer = _outer_tensors(module)
    if world is not None and outer:
        _broadcast_coalesced(outer, src_rank, world)


def share_zero3_weights(module: nn.Module, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A deduped model state dict with the parameters of every ZeRO-3 ParallelModule broadcast from
    the first rank of its data-parallel group (where they are) to the others, which need them to take
    their slices (a full local tensor at a time)."""
    out = dict(state_dict)
    for prefix, pm in parallel_modules(module):
        dp = pm.group("dp")
        if pm._zero3 is None or dp is None:
            continue
        src, device = dist.get_global_rank(dp, 0), runtime_device()
        for info in pm.fullmap.values():
            if not info.is_param:
                continue
            key = prefix + info.original_name
            if dist.get_rank() == src:
                buf = out[key].detach().to(device).contiguous()
            else:
                buf = torch.empty(info.local_shape, dtype=info.dtype, device=device)
            dist.broadcast(buf, src=src, group=dp)
            out[key] = buf
    return out


def _to_cpu(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _broadcast_states(
    names: list[str], by_name: dict[str, Any], src: int, group: dist.ProcessGroup | None
) -> None:
    if group is None or not names:
        return
    payload: list[Any] = [None]
    if dist.get_rank() == src:
        payload[0] = {n: _to_cpu(by_name[n]) for n in names if n in by_name}
    dist.broadcast_object_list(payload, src=src, group=group)
    by_name.update(payload[0])


def broadcast_optimizer_state(module: nn.Module, by_name: dict[str, Any]) -> dict[str, Any]:
    """Fill optimizer states (parameter name -> state) from the first rank of each data-parallel group."""
    by_name = dict(by_name)
    for prefix, pm in parallel_modules(module):
        group = _optimizer_state_group(pm)
        names = [prefix + i.original_name for i in pm.fullmap.values() if i.is_param]
        src = dist.get_global_rank(group, 0) if group is not None else 0
        _broadcast_states(names, by_name, src, group)
    inner = {id(p) for _, pm in parallel_modules(module) for p in pm.parameters()}
    outer = [n for n, p in module.named_parameters() if id(p) not in inner]
    _broadcast_states(outer, by_name, 0, _world())
    return by_name
