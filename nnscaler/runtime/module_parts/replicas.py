"""Identical replicas by construction: every rank cuts its shards from the same full weights.

`parallelize` given a module instance builds the module on every rank, and unless every rank seeded
torch alike the ranks hold different weights: data-parallel replicas would start (and stay) apart
and tensor-parallel ranks would combine shards of different models. `load_initial_weights` loads a
ParallelModule's shards from the module as `init_params_sync` says:

- 'broadcast' (default): rank 0's full tensors (parameters and buffers, non-persistent buffers too)
  are broadcast in buckets of at most `BUCKET_BYTES` on `runtime_device()`, and every rank loads its
  shards from them, as Horovod's `broadcast_parameters` does; the user's module is left as it is.
- 'check': every rank loads its own weights after a checksum of each tensor is compared across the
  ranks; a difference raises naming the first tensor that differs and the ranks that differ.
- 'none': every rank loads its own weights, unchecked.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from nnscaler.errors import ConfigError
from nnscaler.runtime.device import is_initialized, runtime_device
from nnscaler.runtime.grads.buckets import pack_buckets
from nnscaler.runtime.module import ParallelModule
from nnscaler.runtime.shard import shard_slice

__all__ = ["INIT_PARAMS_SYNC", "BUCKET_BYTES", "validate_init_params_sync", "load_initial_weights"]

INIT_PARAMS_SYNC = ("broadcast", "check", "none")
"""Values of parallelize's `init_params_sync`."""
BUCKET_BYTES = 64 << 20
"""Most bytes one broadcast carries (a larger tensor goes alone)."""
_CHUNK = 1 << 22
"""Elements summed at a time by `_checksum` (bounds its float64 temporaries)."""

_FIX = (
    "seed every rank alike (the same torch.manual_seed before building the model), or parallelize with "
    "init_params_sync='broadcast' (the default) so every rank takes rank 0's weights"
)


def validate_init_params_sync(value: object) -> str:
    """The value, checked to be one of `INIT_PARAMS_SYNC`."""
    if value not in INIT_PARAMS_SYNC:
        raise ConfigError(f"init_params_sync={value!r} is not one of {list(INIT_PARAMS_SYNC)}")
    return str(value)


@dataclass
class _Manifest:
    """What one rank holds, exchanged before any weight moves (so every rank decides alike)."""

    sync: str
    has_storage: bool
    names: list[str]
    shapes: list[tuple[int, ...]]
    dtypes: list[str]
    same_as: dict[str, str] = field(default_factory=dict)
    """name -> an earlier name holding the same tensor (tied weights): sent once."""
    checksums: list[tuple[str, ...]] | None = None


def full_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's state dict plus its non-persistent buffers (e.g. rotary inv_freq), tensors only."""
    full = {k: v for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}
    full.update({n: b for n, b in module.named_buffers(remove_duplicate=False) if n not in full})
    return full


def load_initial_weights(
    pm: ParallelModule,
    module: nn.Module,
    sync: str = "broadcast",
    *,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = BUCKET_BYTES,
) -> None:
    """Load `pm`'s shards of `module`'s weights, made identical across ranks as `sync` says.

    Collective over the default process group when it has more than one rank (every rank calls it).
    dtype: the module_dtype given to parallelize (floating tensors are compared in it).
    """
    sync = validate_init_params_sync(sync)
    full = full_weights(module)
    has_storage = not any(p.is_meta for p in module.parameters())
    if not _distributed() or sync == "none":
        if has_storage:
            _load(pm, full)
        return
    mine = _manifest(full, has_storage, sync, dtype)
    everyone: list[_Manifest | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    manifests: list[_Manifest] = everyone  # type: ignore[assignment]
    _check_manifests(manifests)
    if sync == "check":
        _compare_checksums(manifests, set(dict(module.named_parameters(remove_duplicate=False))))
    if sync == "broadcast" and manifests[0].has_storage:
        _broadcast_and_load(pm, full, manifests[0], bucket_bytes)
    elif has_storage:  # 'check', or rank 0 has no weights to give (built on the meta device)
        _load(pm, full)


# ---- manifests --------------------------------------------------------------------------------------


def _distributed() -> bool:
    return is_initialized() and dist.get_world_size() > 1


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _manifest(
    full: Mapping[str, torch.Tensor], has_storage: bool, sync: str, dtype: torch.dtype | None
) -> _Manifest:
    names = [n for n, t in full.items() if not t.is_meta] if has_storage else list(full)
    same_as: dict[str, str] = {}
    if has_storage:
        seen: dict[tuple, str] = {}
        for n in names:
            t = full[n]
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            if key in seen:
                same_as[n] = seen[key]
            else:
                seen[key] = n
    checksums = None
    if sync == "check" and has_storage:
        checksums = [_checksum(_as(full[n], dtype)) for n in names]
    return _Manifest(
        sync=sync,
        has_storage=has_storage,
        names=names,
        shapes=[tuple(full[n].shape) for n in names],
        dtypes=[_dtype_name(full[n].dtype) for n in names],
        same_as=same_as,
        checksums=checksums,
    )


def _as(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def _checksum(t: torch.Tensor) -> tuple[str, ...]:
    """float64 sum, sum of squares and a position-weighted sum (catches permuted values), as hex text."""
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    flat = x.reshape(-1)
    n = flat.numel()
    weights = torch.arange(min(n, _CHUNK), device=flat.device, dtype=torch.float64).remainder_(127).add_(1)
    total = squares = weighted = 0.0
    for start in range(0, n, _CHUNK):
        c = flat[start : start + _CHUNK].to(torch.float64)
        total += float(c.sum())
        squares += float((c * c).sum())
        weighted += float((c * weights[: c.numel()]).sum())
    return tuple(v.hex() if not math.isnan(v) else "nan" for v in (total, squares, weighted))


def _check_manifests(manifests: list[_Manifest]) -> None:
    """Every rank raises alike when the ranks disagree on the mode or hold different models."""
    modes = {m.sync for m in manifests}
    if len(modes) > 1:
        raise ConfigError(
            f"parallelize was called with different init_params_sync on different ranks: "
            f"{[m.sync for m in manifests]} (by rank); pass the same value on every rank"
        )
    ref = manifests[0]
    ref_shapes = dict(zip(ref.names, ref.shapes))
    for r, m in enumerate(manifests[1:], start=1):
        if not (ref.has_storage and m.has_storage):
            continue  # a meta-device module lists everything, a real one what it has: compare shapes only
        shapes = dict(zip(m.names, m.shapes))
        only_0, only_r = sorted(set(ref_shapes) - set(shapes)), sorted(set(shapes) - set(ref_shapes))
        if only_0 or only_r:
            raise RuntimeError(
                f"the module given to parallelize differs between ranks: rank 0 has tensors {only_0[:5]} "
                f"that rank {r} lacks and rank {r} has {only_r[:5]} that rank 0 lacks; build the same model "
                "on every rank"
            )
    for r, m in enumerate(manifests[1:], start=1):
        for name, shape in zip(m.names, m.shapes):
            if name in ref_shapes and ref_shapes[name] != shape:
                raise RuntimeError(
                    f"the module given to parallelize differs between ranks: {name} has shape "
                    f"{list(ref_shapes[name])} on rank 0 and {list(shape)} on rank {r}; build the same model "
                    "on every rank"
                )


def _compare_checksums(manifests: list[_Manifest], param_names: set[str]) -> None:
    ref = next((m for m in manifests if m.checksums is not None), None)
    if ref is None:
        return
    ref_rank = manifests.index(ref)
    by_rank = {
        r: dict(zip(m.names, m.checksums))
        for r, m in enumerate(manifests)
        if m.checksums is not None  # ranks built on the meta device load nothing
    }
    differing = []
    first = None
    for name, value in zip(ref.names, ref.checksums or []):
        ranks = [r for r, sums in by_rank.items() if name in sums and sums[name] != value]
        if ranks:
            differing.append(name)
            if first is None:
                first = (name, ranks)
    if first is None:
        return
    name, ranks = first
    kind = "parameter" if name in param_names else "buffer"
    agree = [r for r in by_rank if r not in ranks]
    raise RuntimeError(
        f"init_params_sync='check': {kind} {name!r} differs between ranks: ranks {ranks} hold other values than "
        f"rank {ref_rank} (ranks {agree} agree); {len(differing)} of {len(ref.names)} tensors differ. The ranks "
        f"built the model from different random numbers: {_FIX}"
    )


# ---- loading --------------------------------------------------------------------------------------------


def _load(pm: ParallelModule, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy `pm`'s shard of each tensor it holds from `tensors` (full tensors by original name)."""
    with torch.no_grad():
        for local, info in pm.fullmap.items():
            key = pm._source_key(tensors, info)
            if key is None:
                continue
            full = tensors[key]
            if tuple(full.shape) != info.full_shape:
                raise ValueError(f"{key}: full shape {tuple(full.shape)} != expected {info.full_shape}")
            pm._write(local, shard_slice(full, info.shard))


def _buckets(ref: _Manifest, bucket_bytes: int) -> list[list[int]]:
    """Indices into `ref.names` of the tensors to send, in buckets of one dtype and at most bucket_bytes."""
    sent = [i for i, name in enumerate(ref.names) if name not in ref.same_as]
    return pack_buckets(
        sent,
        lambda i: ref.dtypes[i],
        lambda i: math.prod(ref.shapes[i]) * getattr(torch, ref.dtypes[i]).itemsize,
        bucket_bytes,
    )


def _broadcast_and_load(
    pm: ParallelModule, full: Mapping[str, torch.Tensor], ref: _Manifest, bucket_bytes: int
) -> None:
    device, is_src = runtime_device(), dist.get_rank() == 0
    tied: dict[str, list[str]] = {}
    for name, first in ref.same_as.items():
        tied.setdefault(first, []).append(name)
    for bucket in _buckets(ref, bucket_bytes):
        dtype = getattr(torch, ref.dtypes[bucket[0]])
        numels = [math.prod(ref.shapes[i]) for i in bucket]
        if is_src:
            pieces = [full[ref.names[i]].detach().reshape(-1).to(device) for i in bucket]
            flat = pieces[0].contiguous() if len(pieces) == 1 else torch.cat(pieces)
        else:
            flat = torch.empty(sum(numels), dtype=dtype, device=device)
        dist.broadcast(flat, src=0)
        received: dict[str, torch.Tensor] = {}
        for i, piece in zip(bucket, flat.split(numels)):
            name = ref.names[i]
            received[name] = piece.view(ref.shapes[i])
            for other in tied.get(name, []):
                received[other] = received[name]
        _load(pm, received)
