"""Checks before a multi-rank module runs a step: its process group exists, and the ranks of one plan
got the same inputs: the same shapes (before their first collective pairs different sizes, which gloo
aborts on and NCCL may hang on) and the same values (different values of one shape would train a
wrong model silently: each rank computes its piece of another batch).

The check costs one all-gather of three int64 per call: a digest of the input shapes and a checksum of
the input values (nnscaler.runtime.dist.checksums: integer sums of each tensor's bytes, computed on the
tensor's device; on CUDA one two-number tensor per device then crosses to the host, which waits for
the device). A rank cannot skip it when its own inputs repeat, since a peer's may have changed (the
last, smaller batch of an epoch), and that peer would then pair its check with this rank's first
model collective. Shapes and per-input checksums are gathered only when the digests differ, to name
them. The exchange runs over a gloo twin of the plan group (groups.create_host_groups) on CPU tensors.
Only the ranks of one plan are compared: data-parallel replicas get different batches.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import struct
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from nnscaler.runtime.dist.checksums import combine_checksums, tensor_checksum
from nnscaler.runtime.dist.process_group import is_initialized
from nnscaler.runtime.dist.host_syncs import host_only

__all__ = ["require_process_group", "check_plan_inputs", "named_call_inputs"]


def require_process_group(owner: str, what: str, rank: int, world_size: int, plan_ngpus: int) -> None:
    """Raise unless a module generated for rank `rank` of `world_size` runs in such a process group."""
    if world_size <= 1:
        return
    how = (
        f"run {world_size} processes under torchrun (one per rank) and call nnscaler.init() before parallelize, "
        "or parallelize with ComputeConfig(1, 1) to run in one process"
    )
    if not is_initialized():
        raise RuntimeError(
            f"{owner}.{what}: this module is rank {rank} of a plan for {world_size} devices "
            f"(plan_ngpus={plan_ngpus}, runtime_ngpus={world_size}) and needs its process group to compute the "
            f"right values, but torch.distributed is not initialised: {how}"
        )
    here = (dist.get_rank(), dist.get_world_size())
    if here != (rank, world_size):
        raise RuntimeError(
            f"{owner}.{what}: this module was generated for rank {rank} of {world_size} but runs as rank "
            f"{here[0]} of {here[1]}: {how}"
        )


@functools.lru_cache(maxsize=256)
def _signature(fn: Any) -> inspect.Signature:
    return inspect.signature(fn)


def named_call_inputs(method: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> list[tuple[str, Any]]:
    """`(argument name, value)` of a call of the bound `method` (positional ones as `args[i]` when they
    cannot be bound to names)."""
    try:
        bound = _signature(method.__func__).bind(method.__self__, *args, **kwargs)
        return list(bound.arguments.items())[1:]
    except (TypeError, ValueError, AttributeError):
        return [(f"args[{i}]", a) for i, a in enumerate(args)] + list(kwargs.items())


def _tensors(named: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, value in named:
        leaves, _ = pytree.tree_flatten_with_path(value)
        for path, leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                yield name + pytree.keystr(path), leaf


def _digest(shapes: Sequence[tuple[str, tuple[int, ...]]]) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<q", len(shapes)))
    for _, shape in shapes:
        h.update(struct.pack(f"<q{len(shape)}q", len(shape), *shape))
    return struct.unpack("<q", h.digest())[0]


def check_plan_inputs(
    owner: str,
    what: str,
    named_inputs: Iterable[tuple[str, Any]],
    group: dist.ProcessGroup | None,
    *,
    rank: int,
    plan_ngpus: int,
    world_size: int,
    values: bool = True,
) -> None:
    """Raise on every rank of `group` (the ranks running one copy of the plan) unless all got tensors of
    the same shapes and, with `values`, the same values (compared by checksum). Collective over `group`,
    a gloo group (groups.get_host_group): the digests are exchanged as CPU tensors. A no-op when `group`
    is None (one rank)."""
    if group is None:
        return
    tensors = list(_tensors(named_inputs))
    shapes = [(name, tuple(t.shape)) for name, t in tensors]
    sums = [tensor_checksum(t) for _, t in tensors] if values else []
    mine = torch.cat([torch.tensor([_digest(shapes)], dtype=torch.int64), combine_checksums(sums)])
    size = dist.get_world_size(group)
    gathered = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(gathered, mine, group=group)
    with host_only():  # a CPU tensor under CUDA too: not a device sync
        rows = {tuple(row) for row in torch.stack(gathered).tolist()}
    if len(rows) == 1:
        return
    ranks = dist.get_process_group_ranks(group)
    if len({row[0] for row in rows}) > 1:
        everyone: list[Any] = [None] * size
        dist.all_gather_object(everyone, shapes, group=group)
        raise ValueError(_mismatch(owner, what, ranks, everyone, rank, plan_ngpus, world_size))
    named_sums = [(n, s.cpu().tolist()) for (n, _), s in zip(tensors, sums)]  # read only when they differ
    gathered_sums: list[Any] = [None] * size
    dist.all_gather_object(gathered_sums, named_sums, group=group)
    raise ValueError(_value_mismatch(owner, what, ranks, gathered_sums, rank, plan_ngpus, world_size))


def _mismatch(
    owner: str,
    what: str,
    ranks: list[int],
    everyone: list[list[tuple[str, tuple[int, ...]]]],
    rank: int,
    plan_ngpus: int,
    world_size: int,
) -> str:
    counts = [len(s) for s in everyone]
    if len(set(counts)) > 1:
        shown = ", ".join(f"{n} on rank {r}" for r, n in zip(ranks, counts))
        found = f"different numbers of tensors: {shown}"
    else:
        differ = [i for i in range(counts[0]) if len({s[i][1] for s in everyone}) > 1]
        first = differ[0]
        name = everyone[ranks.index(rank)][first][0]
        shown = ", ".join(f"{list(s[first][1])} on rank {r}" for r, s in zip(ranks, everyone))
        found = f"{name} has shape {shown}"
        if len(differ) > 1:
            found += f" (also different: {', '.join(everyone[0][i][0] for i in differ[1:])})"
    return (
        f"{owner}.{what}: the ranks that run one copy of the plan (global ranks {ranks}) got inputs of different "
        f"shapes: {found}. {_same_batch(rank, plan_ngpus, world_size)}"
    )


def _same_batch(rank: int, plan_ngpus: int, world_size: int) -> str:
    return (
        "Every rank of a plan must get the same batch (their collectives exchange pieces of it): give each "
        f"data-parallel replica its own data by the data-parallel rank, rank // plan_ngpus (= {rank // plan_ngpus} "
        f"here, of {world_size // plan_ngpus} replicas), not by the global rank"
    )


def _value_mismatch(
    owner: str,
    what: str,
    ranks: list[int],
    everyone: list[list[tuple[str, list[int]]]],
    rank: int,
    plan_ngpus: int,
    world_size: int,
) -> str:
    """Name the first input whose checksums differ and which ranks hold which value."""
    counts = {len(s) for s in everyone}
    differ = [i for i in range(min(counts)) if len({tuple(s[i][1]) for s in everyone}) > 1]
    if not differ:  # some rank sent no checksums
        return (
            f"{owner}.{what}: the ranks that run one copy of the plan (global ranks {ranks}) disagree on "
            "check_input_values: set it alike on every rank"
        )
    first = differ[0]
    holders: dict[tuple[int, ...], list[int]] = {}
    for r, s in zip(ranks, everyone):
        holders.setdefault(tuple(s[first][1]), []).append(r)
    groups = [f"rank {g[0]} has" if len(g) == 1 else f"ranks {g} have" for g in holders.values()]
    found = f"{everyone[0][first][0]} differs: {groups[0]} one value, " + ", ".join(
        f"{g.rsplit(' ', 1)[0]} another" for g in groups[1:]
    )
    if len(differ) > 1:
        found += f" (also different: {', '.join(everyone[0][i][0] for i in differ[1:])})"
    return (
        f"{owner}.{what}: the ranks that run one copy of the plan (global ranks {ranks}) got inputs of the same "
        f"shapes but different values: {found}. {_same_batch(rank, plan_ngpus, world_size)}; random inputs "
        "must be drawn with the same seed on every rank of a plan. (Compared by a checksum of each input's "
        "bytes; module.check_input_values = False compares shapes only.)"
    )
