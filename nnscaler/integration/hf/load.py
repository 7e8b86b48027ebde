"""`load_pretrained`: fill a parallel module from a Hugging Face checkpoint, each rank reading its own slices.

Every rank learns every rank's tensors (`gather_layout`: names and shapes only), so all of them find
the same missing / unexpected keys and shape mismatches and raise the same error before anything is
read. Then each rank reads, for each tensor it holds, only its shard (`HFCheckpoint.read_rows`), and
copies it in as `ParallelModule.load_merged_state_dict` would (`_write`: through the ZeRO-3 reducer
when there is one). Under ZeRO-3 a rank reads only the rows covering its slice of the flat buffer.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from nnscaler.errors import CheckpointError
from nnscaler.integration.hf.reader import HFCheckpoint
from nnscaler.integration.hf.tensors import Held, Layout, gather_layout, held_tensors
from nnscaler.runtime.shard import local_shape

__all__ = ["LoadResult", "load_pretrained", "CONFIG_ATTR"]

_SHOWN = 10
CONFIG_ATTR = "_nnscaler_hf_config"
"""Where load_pretrained keeps the checkpoint's config.json (a dict) on the module, for save_pretrained."""

_increment_version = getattr(torch.autograd.graph, "increment_version", None)


@dataclass
class LoadResult:
    """What `load_pretrained` did on this rank."""

    missing_keys: list[str] = field(default_factory=list)
    """Module tensors under the prefix that the checkpoint lacks (module names; left as they were)."""
    unexpected_keys: list[str] = field(default_factory=list)
    """Checkpoint tensors the module has no place for (checkpoint names; not read)."""
    bytes_read: int = 0
    """Bytes of tensor data this rank read from the checkpoint files."""
    tensors_read: int = 0


def _shown(keys: list[str]) -> str:
    more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
    return f"{keys[:_SHOWN]}{more}"


def _match(layout: Layout, ckpt: HFCheckpoint, prefix: str) -> tuple[dict[str, str], list[str], list[str]]:
    """(canonical module name -> checkpoint key, missing module names, unexpected checkpoint keys)."""
    found: dict[str, str] = {}
    unexpected: list[str] = []
    for key in ckpt.keys():
        canonical = layout.alias.get(prefix + key)
        if canonical is None:
            unexpected.append(key)
        else:
            found.setdefault(canonical, key)
    missing = [
        name
        for name, meta in layout.by_name.items()
        if meta.persistent and name not in found and any(n.startswith(prefix) for n in meta.names)
    ]
    return found, missing, unexpected


def _check(
    layout: Layout, ckpt: HFCheckpoint, prefix: str, strict: bool
) -> tuple[dict[str, str], LoadResult]:
    found, missing, unexpected = _match(layout, ckpt, prefix)
    where = f" (prefix {prefix!r})" if prefix else ""
    if not found:
        example = next(iter(layout.alias), None)
        raise CheckpointError(
            f"load_pretrained: none of the {len(unexpected)} tensors of {ckpt.path} matches the module{where}: "
            f"e.g. checkpoint key {unexpected[0] if unexpected else None!r}, module name {example!r}; pass "
            "prefix= the path of the Hugging Face model inside your module (e.g. prefix='model.')"
        )
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"load_pretrained from {ckpt.path}{where}: missing keys {_shown(missing)}, unexpected keys "
            f"{_shown(unexpected)}; check prefix=, or pass strict=False to load the tensors that match"
        )
    wrong = [
        f"{key}: checkpoint {ckpt.shape(key)} vs module {layout.by_name[name].full_shape}"
        for name, key in found.items()
        if ckpt.shape(key) != tuple(layout.by_name[name].full_shape)
    ]
    if wrong:
        raise CheckpointError(
            f"load_pretrained from {ckpt.path}: shape mismatch for {_shown(wrong)}; the checkpoint was saved "
            "for another model configuration"
        )
    return found, LoadResult(missing, unexpected)


def _load_zero3_slice(ckpt: HFCheckpoint, key: str, held: Held) -> None:
    """ZeRO-3: read only the rows of this rank's shard that overlap its slice of the flat buffer."""
    zero3 = held.pm._zero3
    flat, i = zero3._where[held.local_name]  # the reducer's map: local name -> (flat buffer, index)
    o, n = flat.offsets[i], flat.params[i].numel()
    start, end = max(o, flat.lo), min(o + n, flat.hi)
    if start >= end:
        return
    shape = local_shape(held.meta.full_shape, held.meta.shard)
    row = math.prod(shape[1:]) if shape else 1
    a, b = start - o, end - o
    r0, r1 = a // row, -(-b // row)
    rows = ckpt.read_rows(key, held.meta.shard, (r0, r1) if shape else None).reshape(-1)
    flat.shard[start - flat.lo : end - flat.lo].copy_(rows[a - r0 * row : b - r0 * row])
    if _increment_version is not None:  # a mixed-precision optimizer refreshes its master copy
        _increment_version(flat.params[i])


def _load_one(ckpt: HFCheckpoint, key: str, held: Held) -> None:
    pm = held.pm
    if pm is None:
        held.tensor.copy_(ckpt.read_rows(key, None))
    elif pm._zero3 is not None and held.local_name in pm._zero3:
        _load_zero3_slice(ckpt, key, held)
    else:
        pm._write(held.local_name, ckpt.read_rows(key, held.meta.shard))


def load_pretrained(
    module: nn.Module, path: str | Path, prefix: str = "", *, strict: bool = True
) -> LoadResult:
    """Load a Hugging Face checkpoint directory into `module` (a ParallelModule, or a module holding some).

    `path` holds `model.safetensors.index.json` and its shards, or one `model.safetensors`. `prefix` is
    where the Hugging Face model sits in the module's state dict (e.g. "model." for `self.model =
    Qwen2ForCausalLM(...)`); module tensors outside it are left as they are. Every rank calls it; each
    reads only the slices it holds (under ZeRO-3 only its slice of each flat buffer). Tensors are cast
    to the module's dtypes. Raises `CheckpointError` naming missing / unexpected keys (`strict`) and
    shape mismatches, on every rank, before reading any tensor data. The checkpoint's config.json, if
    any, is kept on `module` for `save_pretrained`.
    """
    held = held_tensors(module)
    layout = gather_layout(held)
    config = _read_config(Path(path) / "config.json")  # a damaged one is named before any weight is read
    with HFCheckpoint(path) as ckpt, torch.no_grad():
        found, result = _check(layout, ckpt, prefix, strict)
        for pm in {id(h.pm): h.pm for h in held if h.pm is not None and h.pm._zero3 is not None}.values():
            pm._zero3.release_all()  # gathered copies would go stale
        for h in held:
            key = found.get(layout.alias[h.name])
            if key is not None:
                _load_one(ckpt, key, h)
        result.bytes_read, result.tensors_read = ckpt.bytes_read, ckpt.tensors_read
    if config is not None:  # save_pretrained writes it back when given no config
        module.__dict__[CONFIG_ATTR] = config
    return result


def _read_config(config: Path) -> dict | None:
    if not config.exists():
        return None
    try:
        return json.loads(config.read_text())
    except ValueError as err:
        raise CheckpointError(
            f"load_pretrained: {config} cannot be read ({err}); it is truncated or damaged: copy it again "
            "from the original checkpoint"
        ) from err
