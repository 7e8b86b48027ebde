"""Communication groups: created once, in the same order on every rank, and cached by their ranks."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch.distributed as dist

from nnscaler.runtime.dist.process_group import is_initialized
from nnscaler.runtime.dist.timeouts import group_timeout

__all__ = [
    "create_groups",
    "get_group",
    "create_twin_groups",
    "get_twin_group",
    "create_host_groups",
    "get_host_group",
    "clear_groups",
]

_GROUPS: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
_TWINS: dict[tuple[str, tuple[int, ...]], dist.ProcessGroup | None] = {}
"""(purpose, ranks) -> a second communicator over those ranks (`create_twin_groups`)."""
_WORLD: list[object] = [None]  # the default group the cache belongs to


def _check_world() -> None:
    world = dist.group.WORLD if is_initialized() else None
    if world is not _WORLD[0]:  # the default group was (re)created or destroyed: drop stale groups
        _GROUPS.clear()
        _TWINS.clear()
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


def create_twin_groups(all_groups: Sequence[Sequence[int]], purpose: str, backend: str | None = None) -> None:
    """Create a second communicator over the ranks of every group in `all_groups`, for `purpose`
    (collective, like `create_groups`). Ops of one NCCL communicator run in order on one stream, so a
    twin lets two streams of work overlap (ZeRO-3's all-gathers beside its reduce-scatters); a gloo
    twin (`backend="gloo"`) exchanges CPU tensors without waiting for the GPU."""
    _check_world()
    for ranks in all_groups:
        key = _key(ranks)
        if (purpose, key) in _TWINS:
            continue
        if len(key) <= 1 or not is_initialized():
            _TWINS[(purpose, key)] = None
        else:
            _TWINS[(purpose, key)] = dist.new_group(list(key), backend=backend, timeout=group_timeout())


def get_twin_group(ranks: Sequence[int], purpose: str) -> dist.ProcessGroup | None:
    """The twin for `purpose` of the group over `ranks` (see `create_twin_groups`); None for one rank."""
    _check_world()
    key = _key(ranks)
    if (purpose, key) in _TWINS:
        return _TWINS[(purpose, key)]
    if len(key) <= 1 or not is_initialized():
        return None
    raise KeyError(
        f"{purpose} group {list(key)} was not created: every rank must create it (create_twin_groups)"
    )


def create_host_groups(all_groups: Sequence[Sequence[int]]) -> None:
    """gloo twins of `all_groups` for host-side agreement checks (CPU tensors: never a GPU sync);
    under a gloo default group the twin is the group itself. Collective, like `create_groups`."""
    if is_initialized() and "nccl" not in str(dist.get_backend()):
        create_groups(all_groups)
        for ranks in all_groups:
            _TWINS[("host", _key(ranks))] = _GROUPS[_key(ranks)]
        return
    create_twin_groups(all_groups, "host", backend="gloo")


def get_host_group(ranks: Sequence[int]) -> dist.ProcessGroup | None:
    """The host (gloo) twin of the group over `ranks` (created by `create_host_groups`)."""
    return get_twin_group(ranks, "host")


def clear_groups() -> None:
    """Forget cached groups (after the default process group is destroyed)."""
    _GROUPS.clear()
    _TWINS.clear()
