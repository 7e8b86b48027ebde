"""`train_step(..., return_outputs=True)` / `infer_step(...)`: every micro-batch's forward output whole
(the loss and whatever else the forward returns, detached), not just the loss.

The rank computing the last stage records its outputs (PipelineStep.loss); at the end of the step they
are broadcast to the other stages of the pipeline (one object broadcast over the "pp" group) and put
back in the forward's structure (the generated `_OUT_SPEC`: a tuple, dict or dataclass, as traced)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

__all__ = ["detached", "share_outputs"]


def detached(outputs: Sequence[Any]) -> tuple[Any, ...]:
    """A stage's outputs as they are recorded: tensors detached, other values kept."""
    return tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outputs)


def _structured(leaves: tuple[Any, ...], spec: Any) -> Any:
    if spec is None:
        return leaves[0] if len(leaves) == 1 else leaves
    return pytree.tree_unflatten(list(leaves), spec)


def share_outputs(model: Any, outputs: list[tuple[Any, ...] | None]) -> list[Any]:
    """Each micro-batch's whole forward output, on every rank of the plan (see the module docstring)."""
    group = model.group("pp")
    if group is not None:
        box = [outputs if dist.get_rank() == model.last_stage_rank else None]
        dist.broadcast_object_list(box, src=model.last_stage_rank, group=group, device=model.device)
        outputs = box[0]
    spec = getattr(sys.modules.get(type(model).__module__), "_OUT_SPEC", None)
    return [_structured(o, spec) for o in outputs]
