"""Fabric checkpoints of a parallel module: restoring one rank's file into `fabric.load`'s state, and
merging a `fabric.save` directory (one `rank{r}.ckpt` per rank) into one single-device checkpoint.

An entry of a rank's dict is a model piece when it holds a ParallelModule's extra state
(`_extra_state`), an optimizer piece when it carries nnscaler's optimizer metadata; the rest (step
counters, user values) is the same on every rank and kept from rank 0."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nnscaler.runtime.checkpoint import merge_state_dicts
from nnscaler.runtime.checkpoint.files import atomic_save, load_file
from nnscaler.runtime.checkpoint.formats import EXTRA_STATE_KEY, OPTIMIZER_META_KEY

__all__ = ["load_into", "merge_fabric_checkpoint"]


def load_into(checkpoint: dict[str, Any], state: Any, strict: bool = True) -> dict[str, Any]:
    """Restore `state`'s modules and optimizers (and replace its plain values) from `checkpoint`, one
    rank's dict; returns the entries `state` did not ask for (all of them when `state` is empty)."""
    if not state:
        return checkpoint
    if isinstance(state, (nn.Module, torch.optim.Optimizer)):
        state.load_state_dict(checkpoint)
        return {}
    missing = [k for k in state if k not in checkpoint]
    if strict and missing:
        raise KeyError(
            f"fabric.load: the checkpoint has no entry {missing[0]!r} (pass strict=False to skip it)"
        )
    for name, obj in list(state.items()):
        if name not in checkpoint:
            continue
        if isinstance(obj, nn.Module):
            obj.load_state_dict(checkpoint.pop(name), strict=strict)
        elif hasattr(obj, "load_state_dict") and hasattr(obj, "state_dict"):
            obj.load_state_dict(checkpoint.pop(name))
        else:
            state[name] = checkpoint.pop(name)
    return checkpoint


def _kind(value: Any) -> str | None:
    if isinstance(value, dict) and EXTRA_STATE_KEY in value:
        return "model"
    if isinstance(value, dict) and OPTIMIZER_META_KEY in value and "param_groups" in value:
        return "optimizer"
    return None


def merge_fabric_checkpoint(checkpoint_dir: str | os.PathLike, output_file: str | os.PathLike) -> None:
    """One model entry (and at most one optimizer entry) merged over the ranks; see the module docstring."""
    files = sorted(Path(checkpoint_dir).glob("rank*.ckpt"), key=lambda p: int(p.stem[4:]))
    if not files:
        raise ValueError(f"merge_checkpoint: no rank*.ckpt files in {checkpoint_dir}")
    ranks = [load_file(f) for f in files]
    kinds = {k: _kind(v) for k, v in ranks[0].items()}
    models = [k for k, kind in kinds.items() if kind == "model"]
    optims = [k for k, kind in kinds.items() if kind == "optimizer"]
    if len(models) != 1 or len(optims) > 1:
        raise ValueError(
            f"merge_checkpoint: expected one model entry and at most one optimizer entry, found models {models} "
            f"and optimizers {optims} in {files[0]}"
        )
    model, opt = merge_state_dicts(
        [r[models[0]] for r in ranks], [r[optims[0]] for r in ranks] if optims else None
    )
    merged = dict(ranks[0])
    merged[models[0]] = model
    if optims:
        merged[optims[0]] = opt
    out = Path(output_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_save(merged, out)
