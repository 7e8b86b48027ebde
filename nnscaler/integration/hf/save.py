"""`save_pretrained`: write a parallel module's weights as a Hugging Face checkpoint directory.

Every rank calls it. All ranks agree on the export plan (`Layout`: every rank's tensor names and
shards): which tensors go into which safetensors file (`max_shard_size`), and which rank sends each
distinct piece (the lowest rank holding it, so replicas send nothing twice). File by file, the
senders hand their pieces to rank 0 (`gather_object`); rank 0 assembles the full tensors, writes the
file and drops them, so it never holds more than one file's tensors. Under ZeRO-3 the ranks of each
ZeRO group gather one flat buffer at a time. Rank 0 writes only the export's own files into `path`,
each atomically, the index last, and leaves every other file there alone (`export_files`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nnscaler.errors import CheckpointError
from nnscaler.integration.hf.export_files import (
    ExportPlan,
    abandon_export,
    config_text,
    finish_export,
    plan_export,
    write_tensors,
)
from nnscaler.integration.hf.load import CONFIG_ATTR
from nnscaler.integration.hf.tensors import Held, Layout, gather_layout, held_tensors
from nnscaler.runtime.checkpoint.files import barrier
from nnscaler.runtime.comm import _all_gather_single
from nnscaler.runtime.device import is_initialized
from nnscaler.runtime.shard import assemble_shards

__all__ = ["save_pretrained", "find_config", "parse_size", "DEFAULT_MAX_SHARD_SIZE"]

DEFAULT_MAX_SHARD_SIZE = "5GB"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_size(size: int | str) -> int:
    """Bytes of `size`: an int, or a string like "5GB" (10**9) or "20KiB" (2**10), as transformers reads it."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"max_shard_size={size!r}: give bytes as an int or a string like '5GB' or '500MiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def find_config(module: nn.Module, prefix: str = "") -> Any:
    """The config `load_pretrained` read into `module`, else the `.config` of the model at `prefix`, or None."""
    if isinstance(module.__dict__.get(CONFIG_ATTR), Mapping):
        return module.__dict__[CONFIG_ATTR]
    where = prefix.rstrip(".")
    try:
        sub = module.get_submodule(where) if where else module
    except AttributeError:
        return None
    config = getattr(sub, "config", None)
    return config if hasattr(config, "to_json_string") or isinstance(config, Mapping) else None


def _export_names(layout: Layout, prefix: str) -> dict[str, str]:
    """Canonical module name -> its key in the export, for every persistent tensor under `prefix`."""
    out: dict[str, str] = {}
    for canonical, meta in layout.by_name.items():
        under = next((n for n in meta.names if n.startswith(prefix)), None)
        if meta.persistent and under is not None:
            out[canonical] = under[len(prefix) :]
    return out


def _plan_files(
    layout: Layout, names: dict[str, str], limit: int, dtype: torch.dtype | None
) -> list[list[str]]:
    """Canonical names grouped into files of at most `limit` bytes (a larger tensor gets a file alone)."""
    files: list[list[str]] = [[]]
    size = 0
    for name in names:
        meta = layout.by_name[name]
        itemsize = (dtype or getattr(torch, meta.dtype)).itemsize
        nbytes = itemsize * int(torch.Size(meta.full_shape).numel())
        if files[-1] and size + nbytes > limit:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    return files if files[-1] else []


class _LocalPieces:
    """This rank's local tensor of each name it holds; under ZeRO-3 gathers one flat buffer at a time."""

    def __init__(self, held: list[Held], layout: Layout) -> None:
        self.by_name = {layout.alias[h.name]: h for h in held}
        self._flat: Any = None
        self._full: torch.Tensor | None = None

    def get(self, name: str) -> torch.Tensor:
        h = self.by_name[name]
        pm = h.pm
        if pm is None:
            return h.tensor.detach()
        zero3 = pm._zero3
        if zero3 is None or h.local_name not in zero3:
            return pm._tensor(h.local_name).detach()
        flat, i = zero3._where[h.local_name]  # the reducer's map: local name -> (flat buffer, index)
        if flat is not self._flat:  # every rank of the ZeRO group asks for the same buffers in order
            full = torch.empty(flat.size, dtype=flat.dtype, device=flat.device)
            _all_gather_single(full, flat.shard, group=zero3.zero_group)
            self._flat, self._full = flat, full
        o = flat.offsets[i]
        return self._full[o : o + flat.params[i].numel()].view(flat.shapes[i])


def _assemble(name: str, meta: Any, pieces: dict[Any, torch.Tensor]) -> torch.Tensor:
    if None in pieces:
        return pieces[None]
    kinds = {(s[0], s[2], s[3]) for s in pieces}
    if len(kinds) != 1:
        raise CheckpointError(
            f"save_pretrained: {name} is split in different ways on different ranks: {kinds}"
        )
    dim, ways, blocks = kinds.pop()
    return assemble_shards({s[1]: t for s, t in pieces.items()}, meta.full_shape, dim, ways, blocks)


def _gather_file(
    names: list[str], layout: Layout, local: _LocalPieces, rank: int, dtype: torch.dtype | None
) -> dict[str, torch.Tensor] | None:
    """The full tensors of one file on rank 0 (None elsewhere); every rank calls it."""
    send: dict[str, dict[Any, torch.Tensor]] = {}
    for name in names:
        if name not in local.by_name:
            continue
        t = local.get(name)  # every holder calls it: ZeRO-3 gathers are collective
        shard = local.by_name[name].meta.shard
        if layout.pieces[name].get(shard) == rank:
            t = t.to(dtype) if dtype is not None else t
            send.setdefault(name, {})[shard] = t.to("cpu", copy=True).contiguous()
    if is_initialized() and dist.get_world_size() > 1:
        box: list[Any] = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(send, box, dst=0)
        if rank != 0:
            return None
    else:
        box = [send]
    merged: dict[str, dict[Any, torch.Tensor]] = {}
    for part in box:
        for name, pieces in part.items():
            merged.setdefault(name, {}).update(pieces)
    return {name: _assemble(name, layout.by_name[name], merged[name]) for name in names}


def _written_dtype(layout: Layout, names: dict[str, str], dtype: torch.dtype | None) -> torch.dtype | None:
    """The floating dtype config.json states: `dtype`, else the one holding most elements written."""
    if dtype is not None:
        return dtype
    count: dict[torch.dtype, int] = {}
    for name in names:
        meta = layout.by_name[name]
        d = getattr(torch, meta.dtype)
        if d.is_floating_point:
            count[d] = count.get(d, 0) + int(torch.Size(meta.full_shape).numel())
    return max(count, key=lambda d: count[d]) if count else None


def _share_error(error: BaseException | None) -> None:
    """Rank 0's failure (or None), raised on every rank."""
    if is_initialized() and dist.get_world_size() > 1:
        box = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None and error is None:
            raise CheckpointError(f"save_pretrained failed on rank 0: {box[0]}")
    if error is not None:
        raise error


def save_pretrained(
    module: nn.Module,
    path: str | Path,
    prefix: str = "",
    config: Any = None,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write `module`'s weights under `prefix` as a Hugging Face checkpoint directory `path`.

    Every rank calls it; rank 0 writes safetensors files of at most `max_shard_size` (one
    `model.safetensors`, or numbered shards and `model.safetensors.index.json`) and `config.json` from
    `config` (a PretrainedConfig or a dict), or from the `.config` of the module at `prefix` when there
    is one. Keys are the module's names without `prefix`; a tied weight is written once, under the
    name the module registered it with. `dtype` casts the tensors on the way out; config.json states
    the dtype written (`dtype`, else the floating dtype of most elements). Only the export's own files
    are written into `path`, each atomically; the user's other files there are left alone, and shards
    of a previous export are removed only when its index (written by nnscaler) named them. A `path`
    that is a file is refused (CheckpointError). Returns `path`.
    """
    path = Path(path)
    limit = parse_size(max_shard_size)
    rank = dist.get_rank() if is_initialized() else 0
    held = held_tensors(module)
    layout = gather_layout(held)
    names = _export_names(layout, prefix)
    if not names:
        raise CheckpointError(f"save_pretrained: the module has no tensor under prefix {prefix!r}")
    files = _plan_files(layout, names, limit, dtype)
    config = config if config is not None else find_config(module, prefix)
    plan: ExportPlan | None = None
    error: BaseException | None = None
    if rank == 0:
        try:
            plan = plan_export(path, len(files))
        except Exception as err:
            error = err
    _share_error(error)  # refused before any gather, on every rank
    local, weight_map, total, numel = _LocalPieces(held, layout), {}, 0, 0
    written: list[str] = []
    for k, group in enumerate(files):
        tensors = _gather_file(group, layout, local, rank, dtype)
        if tensors is None or error is not None:
            continue
        file = plan.files[k]
        try:
            write_tensors(plan, file, {names[n]: t for n, t in tensors.items()})
            written.append(file)
        except Exception as err:  # keep taking part in the gathers; raised on every rank below
            error = err
        for n, t in tensors.items():
            weight_map[names[n]] = file
            total, numel = total + t.numel() * t.element_size(), numel + t.numel()
    if rank == 0 and error is None:
        try:
            text = config_text(config, _written_dtype(layout, names, dtype))
            finish_export(plan, weight_map, total, numel, text)
        except Exception as err:
            error = err
    if rank == 0 and error is not None and plan is not None:
        abandon_export(plan, written)
    _share_error(error)
    barrier()
    return path
