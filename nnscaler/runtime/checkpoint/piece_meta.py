"""Who saved an optimizer state dict: its rank and plan, so `merge_state_dicts` pairs it with the
model state dict of the same rank (a model state dict carries the same in each ParallelModule's
`_extra_state`).

The entry is plain data under the top-level key `OPTIMIZER_META_KEY`, so the state dict still loads
with `torch.load(weights_only=True)` and `optimizer.load_state_dict` ignores it.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from nnscaler.runtime.checkpoint.formats import OPTIMIZER_META_FORMAT, OPTIMIZER_META_KEY, is_parallel_module
from nnscaler.runtime.device import is_initialized

__all__ = ["OPTIMIZER_META_KEY", "OPTIMIZER_META_FORMAT", "optimizer_meta"]


def optimizer_meta(module: nn.Module) -> dict[str, Any]:
    """`{"format", "rank", "plans": {state-dict prefix: plan id}}` of the ParallelModules in `module`."""
    pms = [(f"{n}." if n else "", m) for n, m in module.named_modules() if is_parallel_module(m)]
    if pms:
        rank = pms[0][1].rank
    else:
        rank = dist.get_rank() if is_initialized() else 0
    return {
        "format": OPTIMIZER_META_FORMAT,
        "rank": int(rank),
        "plans": {prefix: pm.plan_id for prefix, pm in pms},
    }
