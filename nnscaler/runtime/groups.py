"""Communication groups: created once, in the same order on every rank, and cached by their ranks."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch.distributed as dist

from nnscaler.runtime.device import is_initialized
from nnscaler.runtime.timeouts import group_timeout

__all__ = ["create_groups", "get_group", "create_host_groups", "get_host_group", "clear_groups"]

_GROUPS: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
_HOST_GROUPS: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
"""gloo twins of groups, for checks whose values live on the host (no device sync on NCCL)."""
_WORLD: list[object] = [None]  # the default group the cache belongs to


def _check_world() -> None:
    world = dist.group.WORLD if is_initialized() else None
    if world is not _WORLD[0]:  # the default group was (re)created or destroyed: drop stale groups
        _GROUPS.clear()
        _HOST_GROUPS.clear()
        _WORLD[0] = world


def _key(ranks: Iterable[int]) -> tuple[int, ...]:
    # torch sorts the ranks of a new group: the rank inside a group is the order of global ranks
    key = tuple(sorted(int(r) for r in ranks))
    if len(set(key)) != len(key):
        raise ValueError(f"group ranks must be distinct, got {list(ranks)}")
    return key


def create_groups(all_groups: Sequence[Sequence[int]]) -> None:
    """Create every group in `all_groups` that does not exist yet.

    Every rank must call this with the same list (`dist.new_group` is collective over the world).
    Groups of one rank, and every group when torch.distributed is not initialised, are `None`.
    """
    _check_world()
    for ranks in all_groups:
        key = _key(ranks)
        if key in _GROUPS:
            continue
        if len(key) <= 1 or not is_initialized():
            _GROUPS[key] = None
            continue
        world = dist.get_world_size()
        if key[-1] >= world or key[0] < 0:
            raise ValueError(f"group {list(key)} has ranks outside the world of {world} processes")
        # without a timeout torch gives a new group its backend's default (gloo: 30 minutes), not the world's
        _GROUPS[key] = dist.new_group(list(key), timeout=group_timeout())


def get_group(ranks: Sequence[int]) -> dist.ProcessGroup | None:
    """The group over `ranks` (created earlier by `create_groups`); `None` for one rank or no dist."""
    _check_world()
    key = _key(ranks)
    if key in _GROUPS:
        return _GROUPS[key]
    if len(key) <= 1 or not is_initialized():
        return None
    raise KeyError(
        f"process group {list(key)} was not created: every rank must create it with create_groups "
        "(in the same order) before use"
    )


def create_host_groups(all_groups: Sequence[Sequence[int]]) -> None:
    """Create a gloo twin of every group in `all_groups` (collective, like `create_groups`): host-side
    agreement checks exchange CPU tensors over it, so they never wait for the GPU. Under a gloo default
    group the twin is the group itself."""
    _check_world()
    for ranks in all_groups:
        key = _key(ranks)
        if key in _HOST_GROUPS:
            continue
        if len(key) <= 1 or not is_initialized():
            _HOST_GROUPS[key] = None
        elif "nccl" not in str(dist.get_backend()):
            create_groups([key])
            _HOST_GROUPS[key] = _GROUPS[key]
        else:
            _HOST_GROUPS[key] = dist.new_group(list(key), backend="gloo", timeout=group_timeout())


def get_host_group(ranks: Sequence[int]) -> dist.ProcessGroup | None:
    """The gloo twin of the group over `ranks` (created by `create_host_groups`); None for one rank."""
    _check_world()
    key = _key(ranks)
    if key in _HOST_GROUPS:
        return _HOST_GROUPS[key]
    if len(key) <= 1 or not is_initialized():
        return None
    raise KeyError(
        f"host (gloo) group {list(key)} was not created: every rank must create it with create_host_groups"
    )


def clear_groups() -> None:
    """Forget cached groups (after the default process group is destroyed)."""
    _GROUPS.clear()
    _HOST_GROUPS.clear()
